/* The I/O worker's per-I/O path, a unit of kvstore._native._lib.

   Why C: in Python the worker spent about as much CPU per 1 MiB page on reading ring
   records, building iocbs, encoding and checking slot headers and answering as the
   checksum itself; on a memory-backed device that CPU is taken from the kernel thread
   that moves the data. One call here does a whole loop turn (reap, validate, answer,
   take, submit); Python keeps what happens once per turn or less: connections coming
   and going, wake-ups (FIFOs, shm/wake.py), logging, health, shutdown.

   The rules are the ones ioworkers/worker.py's docstring gives; the record layouts are
   the numpy dtypes of ipc/iorings.py and ipc/connection.py (tests compare the
   offsets), the slot header the one of storage/header.py and docs/FORMAT.md. */

#include "internal.h"

#define KV_WRITE_BELL 4
#define KV_WRITE_STARVE_NS 2000000LL  /* writes that waited this long behind reads are taken anyway */
/* KV_MAX_DEPTH (kvstore.h): a turn's batch of that many slots lives on the stack */

enum { KV_D_READS, KV_D_READ_BYTES, KV_D_READ_ERRORS, KV_D_WRITES, KV_D_WRITE_BYTES, KV_D_WRITE_ERRORS,
       KV_D_OLDEST, KV_D_LOOP, KV_D_READS_INFLIGHT, KV_D_WRITES_INFLIGHT, KV_D_READS_QUEUED,
       KV_D_WRITES_QUEUED, KV_D_N };

_Static_assert(KV_D_N == sizeof(((struct kv_worker *)0)->didx) / sizeof(int32_t), "didx size");
_Static_assert(KV_NBAD == sizeof(((struct kv_worker *)0)->bad) / sizeof(struct kv_bad), "bad size");

static inline uint64_t kv_now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline uint64_t kv_ring_len(const struct kv_ring *r) {
    return __atomic_load_n(r->tail, __ATOMIC_ACQUIRE) - __atomic_load_n(r->head, __ATOMIC_ACQUIRE);
}

/* Append one record; 0 if the ring is full. Only this process produces on ``r``. */
static int kv_ring_put(struct kv_ring *r, const void *rec, size_t size) {
    uint64_t tail = *r->tail;
    if (tail - __atomic_load_n(r->head, __ATOMIC_ACQUIRE) > r->mask) return 0;
    memcpy(r->recs + (tail & r->mask) * size, rec, size);
    __atomic_store_n(r->tail, tail + 1, __ATOMIC_RELEASE);
    return 1;
}

/* A client's direct-read ring, read with the worker's own head: the client can write both
   shared words, so the tail is range-checked against that head and the shared head is only
   published for the client's room count. Returns the records waiting, or -1 when the tail is
   impossible (more than the ring holds, or behind the head). */
static inline int64_t kv_conn_len(const struct kv_wconn *c) {
    uint64_t n = __atomic_load_n(c->ring.tail, __ATOMIC_ACQUIRE) - c->head;
    return n > c->ring.mask + 1 ? -1 : (int64_t)n;
}

static int kv_conn_get(struct kv_wconn *c, void *rec, size_t size) {
    if (kv_conn_len(c) <= 0) return 0;
    memcpy(rec, c->ring.recs + (c->head & c->ring.mask) * size, size);
    c->head++;
    __atomic_store_n(c->ring.head, c->head, __ATOMIC_RELEASE);
    return 1;
}

static inline uint32_t kv_tagged(uint32_t state, uint32_t gen) { return state | (gen & 0xFFFFFFu) << 8; }

int kv_wk_init(struct kv_worker *w) {
    w->depth = w->read_depth + w->max_writes;
    if (w->read_depth < 1 || w->max_writes < 1 || w->depth > KV_MAX_DEPTH) return -EINVAL;
    w->iocbs = calloc((size_t)w->depth, sizeof(struct iocb));
    w->ptrs = calloc((size_t)w->depth, sizeof(struct iocb *));
    w->pend = calloc((size_t)w->depth, sizeof(struct kv_pend));
    w->free_slots = calloc((size_t)w->depth, sizeof(int32_t));
    w->deferred = calloc((size_t)w->depth, sizeof(struct kv_completion));
    if (!w->iocbs || !w->ptrs || !w->pend || !w->free_slots || !w->deferred) return -ENOMEM;
    for (int i = 0; i < w->depth; i++) w->free_slots[i] = w->depth - 1 - i;
    w->nfree = w->depth;
    w->next_direct = 1ULL << 62;  /* never one of the supervisor's tags (it counts up from 1) */
    w->ctx = 0;
    return io_setup((unsigned)w->depth, &w->ctx);
}

void kv_wk_free(struct kv_worker *w) {
    if (w->ctx) io_destroy(w->ctx);
    w->ctx = 0;
    free(w->iocbs); free(w->ptrs); free(w->pend); free(w->free_slots); free(w->deferred);
    w->iocbs = NULL; w->ptrs = NULL; w->pend = NULL; w->free_slots = NULL; w->deferred = NULL;
}

static void kv_observe(struct kv_worker *w, uint64_t *hist, uint64_t lat_ns) {
    uint64_t us = lat_ns / 1000;
    int b = us ? 64 - __builtin_clzll(us) : 0;
    if (b > w->hist_buckets - 1) b = w->hist_buckets - 1;
    hist[b]++;
}

static void kv_log_bad(struct kv_worker *w, const struct kv_pend *p, const uint8_t *h, int decoded) {
    if (w->nbad >= KV_NBAD) return;
    struct kv_bad *b = &w->bad[w->nbad++];
    memset(b, 0, sizeof *b);
    b->area = p->r.area; b->slot = p->r.slot; b->expected_gen = p->r.gen; b->expected_len = p->r.payload_len;
    b->decoded = (uint32_t)decoded;
    if (decoded) {
        b->found_gen = load64(h + KV_H(gen)); b->found_len = load64(h + KV_H(length)); b->found_slot = load64(h + KV_H(slot));
        b->key_matches = memcmp(h + KV_H(d), p->r.d, 32) == 0;
    }
}

/* Header and payload of a read buffer against what was expected (storage/header.py). */
static int kv_validate(struct kv_worker *w, const struct kv_pend *p) {
    const uint8_t *h = p->bufp;
    uint64_t n = p->r.payload_len;
    if (memcmp(h, "KVSTSLOT", 8) != 0 || load64(h + KV_H(hcsum)) != KV_XXH3(h, KV_FIELDS_SIZE)
            || load32(h + KV_H(version)) != (uint32_t)w->version) {
        kv_log_bad(w, p, h, 0);
        return KV_ST_BAD_HEADER;
    }
    if (memcmp(h + KV_H(store_uuid), w->uuid, 16) != 0 || load32(h + KV_H(device)) != w->dev || load32(h + KV_H(area)) != p->r.area
            || load64(h + KV_H(slot)) != p->r.slot || load64(h + KV_H(gen)) != p->r.gen || memcmp(h + KV_H(d), p->r.d, 32) != 0
            || load64(h + KV_H(length)) != n) {
        kv_log_bad(w, p, h, 1);
        return KV_ST_BAD_HEADER;
    }
    if (KV_XXH3(h + KV_HEADER_BLOCK, n) != load64(h + KV_H(csum))) return KV_ST_BAD_CHECKSUM;
    return KV_ST_OK;
}

/* The header block of a write: header fields, header checksum, the rest of the block zero. */
static void kv_prepare_write(struct kv_worker *w, const struct kv_io_request *r, uint8_t *h) {
    uint64_t n = r->payload_len;
    /* a checksum the client computed while copying the page in is trusted only as far as any
       checksum is: one that does not match the payload makes the page a miss when read */
    uint64_t csum = (r->flags & KV_F_CSUM) ? r->csum : KV_XXH3(h + KV_HEADER_BLOCK, n);
    memset(h, 0, KV_HEADER_BLOCK);
    memcpy(h, "KVSTSLOT", 8);
    store32(h + KV_H(version), (uint32_t)w->version);
    memcpy(h + KV_H(store_uuid), w->uuid, 16);
    store32(h + KV_H(device), w->dev);
    store32(h + KV_H(area), r->area);
    store64(h + KV_H(slot), r->slot);
    store64(h + KV_H(gen), r->gen);
    for (int i = 0; i < 4; i++) store64(h + KV_H(d) + 8 * i, r->d[i]);
    store64(h + KV_H(length), n);
    store64(h + KV_H(csum), csum);
    store64(h + KV_H(written_ns), kv_now_ns(CLOCK_REALTIME));
    store64(h + KV_H(hcsum), KV_XXH3(h, KV_FIELDS_SIZE));
}

static void kv_flush_deferred(struct kv_worker *w) {
    int32_t i = 0;
    while (i < w->ndeferred && kv_ring_put(&w->done, &w->deferred[i], sizeof(struct kv_completion))) i++;
    if (i) {
        memmove(w->deferred, w->deferred + i, (size_t)(w->ndeferred - i) * sizeof(struct kv_completion));
        w->ndeferred -= i;
        w->bell = 1;
    }
    if (w->ndeferred) w->bell = 1;  /* the supervisor must drain ``done``: keep ringing */
}

/* After answering the client's read ``seq``: put the client on this turn's wake list (once per
   turn) when this worker holds none of its reads any more (it waits for all it posted: not
   woken for every page), or when ``seq`` is the read it says it waits for (``wake_seq``: it
   keeps more reads in flight than it waits for, a pipelined get). The word is the client's to
   write: a wrong value only wakes that client too often or too late (it sleeps at most a
   poll interval). The fence pairs with the client's between writing ``wake_seq`` and looking
   at ``wseq`` again: one of the two sees the other's store. */
static inline void kv_wake_client(struct kv_worker *w, struct kv_wconn *c, int32_t ci, uint64_t seq) {
    if (c->wake) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if ((!c->inflight && kv_conn_len(c) <= 0) || seq == __atomic_load_n(c->wake_seq, __ATOMIC_ACQUIRE)) {
        c->wake = 1;
        w->wake_list[w->nwake++] = ci;
    }
}

/* Tell the supervisor of a client's direct read (after the client has its answer). */
static void kv_report_direct(struct kv_worker *w, struct kv_wconn *c, int status, int64_t res, uint64_t lat,
                             uint64_t gen, uint32_t area, uint64_t slot) {
    /* tag: who read (the supervisor drops a connection whose record was refused) */
    uint64_t tag = (uint64_t)c->gen << 32 | (uint32_t)c->cid;
    struct kv_completion rec = {tag, res, status, KV_K_DIRECT, lat, gen, (uint64_t)area << 40 | (slot & ((1ULL << 40) - 1))};
    if (!kv_ring_put(&w->done, &rec, sizeof rec)) {
        w->reports_dropped++;  /* the supervisor is behind: its statistics miss this read */
    } else if (status == KV_ST_REFUSED || kv_ring_len(&w->done) > (w->done.mask + 1) / 4) {
        /* not urgent (the client has its page): the supervisor takes reports at its next tick
           unless they pile up; waking it for each would take a core from clients and workers */
        w->bell = 1;
    }
}

/* Hand a direct read's result to its client, then report it to the supervisor. */
static void kv_answer_direct(struct kv_worker *w, struct kv_pend *p, int status, int64_t res, uint64_t lat) {
    struct kv_wconn *c = &w->conns[p->conn];
    uint32_t b = p->b;
    c->pins[b] = -1;  /* the page is in the buffer: retiring its slot may go on */
    c->wstat[b] = status;
    __atomic_store_n(&c->wseq[b], p->seq, __ATOMIC_RELEASE);
    __atomic_store_n(&c->states[b], KV_A_CLIENT, __ATOMIC_RELEASE);
    c->inflight--;
    __atomic_store_n(c->busy, *c->busy - 1, __ATOMIC_RELEASE);
    kv_wake_client(w, c, p->conn, p->seq);
    if (status == KV_ST_OK && w->ref) {  /* a page read is recently used (CLOCK) */
        const uint64_t gid = w->area_gid[p->r.area] + p->r.slot;
        __atomic_store_n(&w->ref[gid], 1, __ATOMIC_RELAXED);
    }
    kv_report_direct(w, c, status, res, lat, p->r.gen, p->r.area, p->r.slot);
}

/* Answer a direct read without reading anything (a stale or refused record): the buffer goes
   back to the client, which sees a miss. */
static void kv_answer_now(struct kv_worker *w, int32_t ci, uint32_t b, uint64_t seq, int status,
                          const struct kv_direct_request *d) {
    struct kv_wconn *c = &w->conns[ci];
    c->pins[b] = -1;
    c->wstat[b] = status;
    __atomic_store_n(&c->wseq[b], seq, __ATOMIC_RELEASE);
    __atomic_store_n(&c->states[b], KV_A_CLIENT, __ATOMIC_RELEASE);
    __atomic_store_n(c->busy, *c->busy - 1, __ATOMIC_RELEASE);
    kv_wake_client(w, c, ci, seq);
    if (status == KV_ST_REFUSED) kv_report_direct(w, c, status, 0, 0, d->gen, d->area, d->slot);
}

static void kv_complete(struct kv_worker *w, int32_t k, int64_t res, uint64_t now) {
    struct kv_pend *p = &w->pend[k];
    uint64_t lat = now - (uint64_t)p->t0;
    int is_read = p->r.op == KV_OP_READ;
    int status = KV_ST_OK;
    uint64_t *row = w->row;
    if (is_read) w->reads_inflight--; else w->writes_inflight--;
    if (res != (int64_t)p->r.length) {
        status = KV_ST_IO_ERROR;
        row[w->didx[is_read ? KV_D_READ_ERRORS : KV_D_WRITE_ERRORS]]++;
    } else if (is_read) {
        status = kv_validate(w, p);
        row[w->didx[KV_D_READS]]++;
        row[w->didx[KV_D_READ_BYTES]] += (uint64_t)res;
    } else {
        row[w->didx[KV_D_WRITES]]++;
        row[w->didx[KV_D_WRITE_BYTES]] += (uint64_t)res;
    }
    kv_observe(w, is_read ? w->hread : w->hwrite, lat);
    if (p->conn >= 0) {
        __atomic_store_n(&w->wpins[k], -1, __ATOMIC_RELEASE);  /* the page is in the buffer */
        kv_answer_direct(w, p, status, res, lat);
    } else {
        struct kv_completion rec = {p->r.tag, res, status, KV_K_SUPERVISOR, lat, 0, 0};
        if (w->ndeferred || !kv_ring_put(&w->done, &rec, sizeof rec))
            w->deferred[w->ndeferred++] = rec;  /* at most one per slot: ``depth`` suffices */
        /* a read is waited for: wake the supervisor. A write in a stream of them is not, one by
           one: wake it for every KV_WRITE_BELL of them, or when the stream pauses (none left in
           flight or queued: a put may wait for this one, or the supervisor have more to post) */
        if (is_read || !w->writes_inflight || !kv_ring_len(&w->writes) || kv_ring_len(&w->done) >= KV_WRITE_BELL)
            w->bell = 1;
    }
    p->t0 = 0;  /* free (kv_wk_turn's oldest I/O skips it) */
    w->free_slots[w->nfree++] = k;
}

int kv_wk_reap(struct kv_worker *w, int min_nr, int64_t timeout_ns) {
    struct io_event ev[256];
    if (!w->outstanding) return 0;
    if (min_nr > w->outstanding) min_nr = (int)w->outstanding;
    struct timespec ts = {timeout_ns / 1000000000LL, timeout_ns % 1000000000LL};
    int r;
    do { r = io_getevents(w->ctx, min_nr, 256, ev, &ts); } while (r == -EINTR);
    if (r <= 0) return r;
    uint64_t now = kv_now_ns(CLOCK_MONOTONIC);
    for (int i = 0; i < r; i++) {
        w->outstanding--;
        kv_complete(w, (int32_t)(uintptr_t)ev[i].data, (int64_t)(long)ev[i].res, now);
    }
    kv_flush_deferred(w);
    return r;
}

static int32_t kv_slot(struct kv_worker *w, uint64_t now) {
    int32_t k = w->free_slots[--w->nfree];
    w->pend[k].t0 = (int64_t)now;
    return k;
}

/* Give back an I/O slot taken for a direct read that is answered without a read. */
static void kv_unslot(struct kv_worker *w, int32_t k) {
    __atomic_store_n(&w->wpins[k], -1, __ATOMIC_RELEASE);
    w->pend[k].t0 = 0;
    w->free_slots[w->nfree++] = k;
}

static void kv_prep(struct kv_worker *w, int32_t k, int write, uint64_t offset, int32_t *batch, int *n) {
    struct kv_pend *p = &w->pend[k];
    char *buf = (char *)p->bufp;
    if (write) io_prep_pwrite(&w->iocbs[k], w->fd, buf, (size_t)p->r.length, (long long)offset);
    else io_prep_pread(&w->iocbs[k], w->fd, buf, (size_t)p->r.length, (long long)offset);
    w->iocbs[k].data = (void *)(uintptr_t)k;
    batch[(*n)++] = k;
}

/* Take the supervisor's next request from ``ring`` with the buffer it names, as this worker maps
   it (the lease of the connection whose generation the request carries). Returns 1 with *bufp
   set (NULL: that connection is gone, the request fails), 0 if the ring is empty, -1 if the
   connection is in the table but not attached here yet (the request stays queued; Python
   follows the table, then the next turn takes it). */
static int kv_take_sup(struct kv_worker *w, struct kv_ring *ring, struct kv_io_request *r, uint8_t **bufp) {
    uint64_t head = *ring->head;
    if (__atomic_load_n(ring->tail, __ATOMIC_ACQUIRE) == head) return 0;
    memcpy(r, ring->recs + (head & ring->mask) * sizeof *r, sizeof *r);
    *bufp = NULL;
    uint32_t k = w->per_lease ? r->buf / w->per_lease : 0;
    if (w->per_lease && k < w->nleases) {
        uint32_t g = (uint32_t)r->conn_gen;
        if (w->lease_base[k] && w->lease_gen[k] == g) {
            *bufp = w->lease_base[k] + (uint64_t)(r->buf % w->per_lease) * w->bsize;
        } else if ((uint32_t)__atomic_load_n(&w->table[8 * (uint64_t)k], __ATOMIC_ACQUIRE) == g && g) {
            w->need_attach = 1;
            return -1;
        }
    }
    __atomic_store_n(ring->head, head + 1, __ATOMIC_RELEASE);
    return 1;
}

/* A supervisor request the worker does not carry out: a buffer outside the arena, a transfer
   that is not one slot, an offset that is not the slot's the request names, or a write outside
   this server's own area. The supervisor never sends one; the check is what makes the rings'
   content input, not authority (no record can write the superblocks or another server's area). */
static int kv_request_ok(const struct kv_worker *w, const struct kv_io_request *r, int write) {
    if (!(r->buf < (uint64_t)w->per_lease * w->nleases && r->length >= KV_HEADER_BLOCK && r->length <= w->bsize
          && r->payload_len <= r->length - KV_HEADER_BLOCK))
        return 0;
    if (r->area >= w->n_areas || r->slot >= w->area_slots[r->area] || r->length > w->slot_size
            || r->offset != w->area_off[r->area] + r->slot * w->slot_size)
        return 0;
    return !write || r->area == w->own_area;
}

/* The register of slot ``gid`` as the service wrote it, read between two looks at its state
   and generation; 0 unless it holds a VALID page throughout. */
static int kv_register(const struct kv_worker *w, uint64_t gid, struct kv_slot *out) {
    const struct kv_slot *s = (const struct kv_slot *)w->slots + gid;
    uint8_t s1 = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
    uint64_t g1 = __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
    for (int i = 0; i < 4; i++) out->d[i] = __atomic_load_n(&s->d[i], __ATOMIC_RELAXED);
    out->length = __atomic_load_n(&s->length, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t g2 = __atomic_load_n(&s->gen, __ATOMIC_RELAXED);
    uint8_t s2 = __atomic_load_n(&s->state, __ATOMIC_RELAXED);
    out->gen = g1;
    out->state = s1;
    return s1 == KV_SLOT_VALID && s2 == KV_SLOT_VALID && g1 == g2;
}

/* Stop serving a connection that wrote what no honest client writes; the supervisor hears of
   it (a refused report) and drops it. Its buffers still handed over are taken back there. */
static void kv_refuse(struct kv_worker *w, struct kv_wconn *c, const struct kv_direct_request *d) {
    struct kv_direct_request none;
    if (!d) { memset(&none, 0, sizeof none); d = &none; }
    if (!c->refused) kv_report_direct(w, c, KV_ST_REFUSED, 0, 0, d->gen, d->area, d->slot);
    c->refused = 1;
    w->refused++;
}

/* Clients' direct reads, authorized by the service's own state (docs/SECURITY.md): the record
   names a slot, the key id (unsalted) and the generation the client found; the page is read
   against the slot table's register, and only if the key id, salted with the connection's
   tenant salt (which only the service and the workers know), is the register's digest. A record
   whose generation is the register's but whose key is not is a lie: the connection is refused. */
static int kv_take_direct(struct kv_worker *w, int room, uint64_t now, int32_t *batch, int *n) {
    int taken = 0, busy = 0;
    if (w->nconn <= 0) return 0;
    for (int32_t j = 0; j < w->nconn; j++) {
        struct kv_wconn *c = &w->conns[j];
        if (!c->live || c->refused) continue;
        int64_t len = kv_conn_len(c);
        if (len < 0) kv_refuse(w, c, NULL);  /* an impossible tail: nothing of its ring is read */
        else if (len) busy++;
    }
    if (!busy) return 0;
    /* fair: each turn starts at the next live connection (round robin over those, not over the
       table's slots, most of which are empty), and takes at most an equal share of the room
       from each while others wait (one client's deep batch must not hold the device) */
    for (int32_t j = 1; j <= w->nconn; j++) {
        int32_t ci = (w->rr + j) % w->nconn;
        if (w->conns[ci].live) { w->rr = ci; break; }
    }
    int share = room / busy > 1 ? room / busy : 1;
    for (int32_t j = 0; j < w->nconn && taken < room; j++) {
        int32_t ci = (w->rr + j) % w->nconn;
        struct kv_wconn *c = &w->conns[ci];
        if (!c->live || c->refused) continue;
        int mine = 0;
        struct kv_direct_request d;
        while (mine < share && taken < room && !c->refused && kv_conn_get(c, &d, sizeof d)) {
            mine++;
            if (!(d.buf < c->lease_count && d.area < w->n_areas && d.slot < w->area_slots[d.area])) {
                kv_refuse(w, c, &d);  /* a record no honest client writes: nothing is read for it */
                break;
            }
            uint32_t i = c->lease_start + d.buf;
            if (__atomic_load_n(&c->dseq[d.buf], __ATOMIC_ACQUIRE) != d.seq) {
                /* a stale record (its read was taken back, the buffer perhaps posted again since,
                   maybe to another device): skipped without touching the buffer's state, which a
                   worker taking the record of its current read may be about to swap; it costs
                   no I/O slot, so it does not count against the turn's share */
                mine--;
                continue;
            }
            /* busy before the buffer is taken: the supervisor takes a gone client's posted
               buffers back (DIRECT -> FREE), fences, and frees the lease only when no worker is
               busy with it, so one of the two sees the other (a state word, which the client
               can write, is never what keeps or frees a connection) */
            __atomic_store_n(c->busy, *c->busy + 1, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            int took = 0;
            for (int tries = 0; tries < 8; tries++) {
                uint32_t expected = kv_tagged(KV_A_DIRECT, c->gen);
                if (__atomic_compare_exchange_n(&c->states[d.buf], &expected, kv_tagged(KV_A_READING, c->gen), 0,
                                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                    took = 1;
                    break;
                }
                /* READING while its dseq is still this record's: another worker swapped it for
                   an instant for a stale record of the buffer (it swaps it back once it sees
                   dseq): yield and try again; anything else is final */
                if (expected != kv_tagged(KV_A_READING, c->gen)
                        || __atomic_load_n(&c->dseq[d.buf], __ATOMIC_ACQUIRE) != d.seq)
                    break;
                sched_yield();
            }
            if (!took) {
                __atomic_store_n(c->busy, *c->busy - 1, __ATOMIC_RELEASE);
                continue;  /* taken back by the client (timed out), or not this connection's to give */
            }
            if (__atomic_load_n(&c->dseq[d.buf], __ATOMIC_ACQUIRE) != d.seq) {
                /* a stale record (its read was taken back) for a buffer posted again since:
                   leave the buffer to the record of the read it is posted for now */
                __atomic_store_n(&c->states[d.buf], kv_tagged(KV_A_DIRECT, c->gen), __ATOMIC_RELEASE);
                __atomic_store_n(c->busy, *c->busy - 1, __ATOMIC_RELEASE);
                continue;
            }
            struct kv_slot reg;
            uint64_t gid = w->area_gid[d.area] + d.slot;
            /* the worker pins the slot itself before it looks at the register: the supervisor
               retires a slot, fences, and reuses it only while no worker pins it, so either it
               sees this pin or this look sees the retirement. What a client writes in its own
               pin words is never asked (a client could pin anyone's slots with them) */
            int32_t k = kv_slot(w, now);
            __atomic_store_n(&w->wpins[k], (int64_t)gid, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            int valid = kv_register(w, gid, &reg);
            if (!valid || reg.gen != d.gen || !reg.length || reg.length > w->page_size) {
                kv_unslot(w, k);
                kv_answer_now(w, ci, d.buf, d.seq, KV_ST_STALE, &d);  /* changed since the client looked */
                continue;
            }
            uint8_t salted[32];
            kv_b2b_256_from(c->keyed, 128, (const uint8_t *)d.d, 32, salted);
            if (memcmp(salted, reg.d, 32) != 0) {
                if (c->has_prev) {  /* found under the salt an invalidate replaced a moment ago: no
                                       lie, a page of the old key space, so a miss */
                    kv_b2b_256_from(c->keyed_prev, 128, (const uint8_t *)d.d, 32, salted);
                    if (memcmp(salted, reg.d, 32) == 0) {
                        kv_unslot(w, k);
                        kv_answer_now(w, ci, d.buf, d.seq, KV_ST_STALE, &d);
                        continue;
                    }
                }
                kv_unslot(w, k);
                kv_answer_now(w, ci, d.buf, d.seq, KV_ST_REFUSED, &d);
                kv_refuse(w, c, &d);
                break;
            }
            uint64_t len = reg.length;
            struct kv_pend *p = &w->pend[k];
            memset(&p->r, 0, sizeof p->r);
            p->r.tag = w->next_direct++;
            p->r.op = KV_OP_READ; p->r.buf = i; p->r.area = d.area; p->r.slot = d.slot; p->r.gen = reg.gen;
            p->r.payload_len = len;
            p->r.length = KV_HEADER_BLOCK + (len + 4095) / 4096 * 4096;
            memcpy(p->r.d, reg.d, 32);
            p->conn = ci; p->b = d.buf; p->seq = d.seq;
            p->bufp = c->base + (uint64_t)d.buf * w->bsize;
            c->inflight++;
            w->reads_inflight++;
            taken++;
            kv_prep(w, k, 0, w->area_off[d.area] + d.slot * w->slot_size, batch, n);
        }
    }
    return taken;
}

static int kv_direct_waiting(const struct kv_worker *w) {
    for (int32_t j = 0; j < w->nconn; j++)
        if (w->conns[j].live && !w->conns[j].refused && kv_conn_len(&w->conns[j]) > 0) return 1;
    return 0;
}

/* Submit the prepared slots; a request the kernel refuses fails alone (-errno), the rest go on. */
static void kv_submit_batch(struct kv_worker *w, int32_t *batch, int n) {
    for (int i = 0; i < n; i++) w->ptrs[i] = &w->iocbs[batch[i]];
    int done = 0;
    while (done < n) {
        int r = io_submit(w->ctx, n - done, w->ptrs + done);
        if (r > 0) { done += r; w->outstanding += r; continue; }
        if (r == -EINTR) continue;
        if ((r == -EAGAIN || r == 0) && w->outstanding) { kv_wk_reap(w, 1, 1000000); continue; }
        /* the device refused the request: fail it and go on with the rest */
        kv_complete(w, batch[done], r < 0 ? r : -EAGAIN, kv_now_ns(CLOCK_MONOTONIC));
        done++;
    }
}

/* One loop turn: reap what finished, take reads (the supervisor's, then the clients' direct
   ones), take writes only when no read waits, submit. Returns how many I/Os it took. */
int kv_wk_turn(struct kv_worker *w) {
    int32_t batch[KV_MAX_DEPTH];
    int n = 0;
    uint64_t now;
    if (w->ndeferred) kv_flush_deferred(w);
    if (w->outstanding) kv_wk_reap(w, 0, 0);
    now = kv_now_ns(CLOCK_MONOTONIC);
    /* while the supervisor does not drain its completions, take none of its requests */
    int sup_ok = w->ndeferred == 0;
    int room = w->read_depth - (int)w->reads_inflight;
    struct kv_io_request r;
    uint8_t *bufp;
    int got;
    while (sup_ok && room > 0 && (got = kv_take_sup(w, &w->reads, &r, &bufp)) != 0) {
        if (got < 0) break;  /* its connection is not attached yet: follow the table first */
        int32_t k = kv_slot(w, now);
        w->pend[k].r = r; w->pend[k].conn = -1; w->pend[k].bufp = bufp;
        w->reads_inflight++;
        room--;
        if (!bufp || !kv_request_ok(w, &r, 0)) { kv_complete(w, k, bufp ? -EINVAL : -ESTALE, now); continue; }
        kv_prep(w, k, 0, r.offset, batch, &n);
    }
    if (room > 0) kv_take_direct(w, room, now, batch, &n);
    room = w->max_writes - (int)w->writes_inflight;
    /* writes wait while reads do, but not without bound: a client that keeps its ring busy (or
       claims to) must not stop every put. Writes that waited KV_WRITE_STARVE_NS go anyway. */
    int reads_wait = kv_ring_len(&w->reads) || kv_direct_waiting(w);
    if (!kv_ring_len(&w->writes) || !reads_wait) w->writes_waiting_since = 0;
    else if (!w->writes_waiting_since) w->writes_waiting_since = (int64_t)now;
    int starved = w->writes_waiting_since && (int64_t)now - w->writes_waiting_since >= KV_WRITE_STARVE_NS;
    if (sup_ok && room > 0 && (!reads_wait || starved)) {
        if (starved) w->writes_waiting_since = (int64_t)now;
        while (room > 0 && (got = kv_take_sup(w, &w->writes, &r, &bufp)) != 0) {
            if (got < 0) break;
            int32_t k = kv_slot(w, now);
            w->pend[k].r = r; w->pend[k].conn = -1; w->pend[k].bufp = bufp;
            w->writes_inflight++;
            room--;
            if (!bufp || !kv_request_ok(w, &r, 1)) { kv_complete(w, k, bufp ? -EINVAL : -ESTALE, now); continue; }
            kv_prepare_write(w, &r, bufp);
            kv_prep(w, k, 1, r.offset, batch, &n);
        }
    }
    if (n) kv_submit_batch(w, batch, n);
    /* health, judged by the supervisor: the age of the oldest I/O the device holds, and that
       this loop still turns */
    int64_t oldest = 0;
    for (int32_t i = 0; w->nfree < w->depth && i < w->depth; i++) {
        int64_t t = w->pend[i].t0;  /* 0: a free slot */
        if (t && (!oldest || t < oldest)) oldest = t;
    }
    uint64_t *row = w->row;
    row[w->didx[KV_D_OLDEST]] = (uint64_t)oldest;
    row[w->didx[KV_D_LOOP]] = kv_now_ns(CLOCK_MONOTONIC);
    row[w->didx[KV_D_READS_INFLIGHT]] = (uint64_t)w->reads_inflight;
    row[w->didx[KV_D_WRITES_INFLIGHT]] = (uint64_t)w->writes_inflight;
    row[w->didx[KV_D_READS_QUEUED]] = kv_ring_len(&w->reads);
    row[w->didx[KV_D_WRITES_QUEUED]] = kv_ring_len(&w->writes);
    return n;
}
