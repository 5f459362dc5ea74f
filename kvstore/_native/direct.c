/* A client's direct reads, posted: a unit of kvstore._native._lib.

   Why C: posting a batch of direct reads in numpy (pin, read the slot entries, compare them,
   build the records, hand the buffers over, fill the rings) cost about 140 us of the client's
   CPU per call whatever the batch (measured: a 16-page get, 256 KiB pages, took 430 us of
   client CPU, a third of it here); at 256 KiB pages that fixed cost, not the device, bounded
   what one client read. The protocol is the one client.py ``_post_direct`` and
   ipc/connection.py describe; this is its loop, unchanged. */

#include "internal.h"

#define KV_POST_CHUNK 256  /* keys whose slot entries are copied at once (on the stack) */

/* The device of global slot ``gid`` and its area and slot there: ``bases`` holds each
   (device, area)'s first gid, in order (an empty area shares its base with the next: the last
   base not above gid is the area that holds it). */
static void kv_locate(const int64_t *bases, int64_t nbases, int64_t nareas, int64_t gid,
                      uint32_t *dev, uint32_t *area, uint64_t *slot) {
    int64_t lo = 0, hi = nbases;  /* first base > gid */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (bases[mid] <= gid) lo = mid + 1; else hi = mid;
    }
    int64_t k = lo - 1;
    *dev = (uint32_t)(k / nareas);
    *area = (uint32_t)(k % nareas);
    *slot = (uint64_t)(gid - bases[k]);
}

/* Post the direct reads of n keys. Key i was found at slot gids[i] (-1: a miss) with salted
   digest words[4i..4i+4) and key id ids[4i..4i+4); its lease buffer (lease-relative) is
   bufs[i], ours (CLIENT). For each hit: pin the slot in pins[], fence, check the entry is still
   VALID with that digest and an unchanged generation (read before and after), then hand the
   buffer over (states[b] = direct_state), note dseq/ddev and append the record to its device's
   ring; a ring without room takes it back (a miss). Records get seqs from *seq on. Returns the
   reads posted: rows_out, lbs_out, seqs_out get the key row, buffer and seq of each;
   woken[dev] = 1 for each device a record went to (the caller posts its worker's wake-up). */
int64_t kv_post_direct(const void *slotsv, uint64_t nslots, const int64_t *gids, const uint64_t *words,
                       const uint64_t *ids, const int64_t *bufs, int64_t n, int64_t *pins, uint64_t *dseq,
                       uint32_t *ddev, uint32_t *states, uint32_t direct_state, const int64_t *bases,
                       int64_t nbases, int64_t nareas, struct kv_ring *rings, int64_t ndev, uint64_t *seq,
                       int64_t *rows_out, int64_t *lbs_out, uint64_t *seqs_out, uint8_t *woken) {
    const volatile struct kv_slot *slots = slotsv;
    uint64_t gen0[KV_POST_CHUNK];
    struct kv_slot seen[KV_POST_CHUNK];
    int64_t posted = 0;
    for (int64_t c0 = 0; c0 < n; c0 += KV_POST_CHUNK) {  /* a chunk's entries are copied on the stack */
        const int64_t c1 = n - c0 < KV_POST_CHUNK ? n : c0 + KV_POST_CHUNK;
        for (int64_t i = c0; i < c1; i++)
            if (gids[i] >= 0 && (uint64_t)gids[i] < nslots) pins[bufs[i]] = gids[i];
        __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* pin, then look: the supervisor retires, then looks at the pins */
        /* the entry is read between two reads of its generation: retiring a slot writes its state,
           then its generation, so an entry seen VALID here was seen with the generation it had
           while VALID, or the two reads differ (then it is a miss) */
        for (int64_t i = c0; i < c1; i++) {
            if (gids[i] < 0 || (uint64_t)gids[i] >= nslots) continue;
            const volatile struct kv_slot *s = &slots[gids[i]];
            struct kv_slot *e = &seen[i - c0];
            gen0[i - c0] = s->gen;
            e->gen = s->gen;
            for (int j = 0; j < 4; j++) e->d[j] = s->d[j];
            e->length = s->length;
            e->state = s->state;
        }
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        for (int64_t i = c0; i < c1; i++) {
            const int64_t g = gids[i];
            if (g < 0 || (uint64_t)g >= nslots) continue;
            const int64_t b = bufs[i];
            const struct kv_slot *e = &seen[i - c0];
            int ok = e->state == KV_SLOT_VALID && e->gen == gen0[i - c0] && slots[g].gen == gen0[i - c0];
            for (int j = 0; j < 4 && ok; j++) ok = e->d[j] == words[4 * i + j];
            struct kv_direct_request r;
            uint32_t dev = 0, area = 0;
            if (ok) {
                kv_locate(bases, nbases, nareas, g, &dev, &area, &r.slot);
                ok = (int64_t)dev < ndev;
            }
            uint64_t tail = ok ? *rings[dev].tail : 0;  /* only we write it */
            if (ok && tail - __atomic_load_n(rings[dev].head, __ATOMIC_ACQUIRE) > rings[dev].mask)
                ok = 0;  /* no room: stale records fill it (its worker is not taking them) */
            if (!ok) {  /* changed since the index said so, or no room: a miss */
                pins[b] = -1;
                continue;
            }
            r.seq = (*seq)++;
            r.buf = (uint16_t)b;
            r.area = (uint16_t)area;
            r.payload_len = e->length;
            r.gen = e->gen;
            for (int j = 0; j < 4; j++) r.d[j] = ids[4 * i + j];  /* the key id: the worker salts it itself */
            dseq[b] = r.seq;
            ddev[b] = dev;
            __atomic_store_n(&states[b], direct_state, __ATOMIC_RELEASE);  /* the worker's from here on */
            memcpy(rings[dev].recs + (tail & rings[dev].mask) * sizeof r, &r, sizeof r);
            __atomic_store_n(rings[dev].tail, tail + 1, __ATOMIC_RELEASE);
            woken[dev] = 1;
            rows_out[posted] = i;
            lbs_out[posted] = b;
            seqs_out[posted] = r.seq;
            posted++;
        }
    }
    return posted;
}
