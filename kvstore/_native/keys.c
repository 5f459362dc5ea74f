/* Key digests and the lock-free key-index lookup, a unit of kvstore._native._lib.

   Why C: a lookup of 1,000 keys hashed twice per key in a Python loop costs about a
   millisecond; here the whole batch is one call. BLAKE2b is written from RFC 7693
   (sequential mode, 64-bit words, 12 rounds); tests/test_digests.py checks it
   against hashlib's for random keys, key lengths and salts. */

#include "internal.h"

static const uint64_t B2B_IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

static const uint8_t B2B_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

/* The mixing function G and one round over v[16] with message words m[16], written once for
   both a uint64_t and a vector of them (the shifts and adds work lane by lane). */
#define B2B_ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define B2B_G(a, b, c, d, x, y)                    \
    do {                                           \
        v[a] = v[a] + v[b] + (x);                  \
        v[d] = B2B_ROTR(v[d] ^ v[a], 32);          \
        v[c] = v[c] + v[d];                        \
        v[b] = B2B_ROTR(v[b] ^ v[c], 24);          \
        v[a] = v[a] + v[b] + (y);                  \
        v[d] = B2B_ROTR(v[d] ^ v[a], 16);          \
        v[c] = v[c] + v[d];                        \
        v[b] = B2B_ROTR(v[b] ^ v[c], 63);          \
    } while (0)
#define B2B_ROUND(s)                               \
    do {                                           \
        B2B_G(0, 4, 8, 12, m[s[0]], m[s[1]]);      \
        B2B_G(1, 5, 9, 13, m[s[2]], m[s[3]]);      \
        B2B_G(2, 6, 10, 14, m[s[4]], m[s[5]]);     \
        B2B_G(3, 7, 11, 15, m[s[6]], m[s[7]]);     \
        B2B_G(0, 5, 10, 15, m[s[8]], m[s[9]]);     \
        B2B_G(1, 6, 11, 12, m[s[10]], m[s[11]]);   \
        B2B_G(2, 7, 8, 13, m[s[12]], m[s[13]]);    \
        B2B_G(3, 4, 9, 14, m[s[14]], m[s[15]]);    \
    } while (0)

/* RFC 7693 section 3.2, function F: compress one 128-byte block into h. t is the byte
   count so far (messages here are far below 2^64 bytes, so the high counter word is 0). */
static void b2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) { v[i] = h[i]; v[i + 8] = B2B_IV[i]; }
    v[12] ^= t;
    if (last) v[14] = ~v[14];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    /* unrolled, the message schedule is constant: m stays in registers (about 2x faster) */
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) B2B_ROUND(B2B_SIGMA[r]);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-256 state after absorbing a key (keylen 1..64), zero-padded to the first block: the
   same for every message hashed under that key, so a batch computes it once. */
static void b2b_256_keyed_init(uint64_t h[8], const uint8_t *key, size_t keylen) {
    uint8_t block[128];
    for (int i = 0; i < 8; i++) h[i] = B2B_IV[i];
    h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ 32;
    memset(block, 0, 128);
    memcpy(block, key, keylen);
    b2b_compress(h, block, 128, 0);
}

/* Finish BLAKE2b-256 of msg (len > 0) from state h0, which has absorbed t0 bytes (0: unkeyed,
   128: keyed); h0 holds the parameter block for a 32-byte digest. */
void kv_b2b_256_from(const uint64_t *h0, uint64_t t0, const uint8_t *msg, size_t len, uint8_t *out) {
    uint64_t h[8];
    uint8_t block[128];
    uint64_t t = t0;
    memcpy(h, h0, sizeof h);
    while (len > 128) {
        t += 128;
        b2b_compress(h, msg, t, 0);
        msg += 128;
        len -= 128;
    }
    memset(block, 0, 128);
    memcpy(block, msg, len);
    t += len;
    b2b_compress(h, block, t, 1);
    for (int i = 0; i < 4; i++) store64(out + 8 * i, h[i]);
}

static void b2b_256_unkeyed_init(uint64_t h[8]) {
    for (int i = 0; i < 8; i++) h[i] = B2B_IV[i];
    h[0] ^= 0x01010000ULL ^ 32;
}

/* Several hashes at once: lane j of every vector belongs to message j, so one pass of the 12
   rounds compresses LANES blocks. Written once with GCC vector extensions; target_clones builds it
   for AVX-512 (8 native lanes, with a rotate instruction), AVX2 and the baseline, and the loader
   picks the best the CPU has. Only single-block messages (keys of 1..128 bytes, and every key id)
   go this way; longer keys take the scalar path above. */
#define LANES 8
typedef uint64_t u64xL __attribute__((vector_size(8 * LANES)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KV_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KV_CLONES
#endif

/* The rounds of one final block in every lane: state h0 for all lanes, byte counters t,
   message words m; digest of lane j (j < count) to out + 32 * j. Inlined into its callers, so
   message words they leave constant (zero) are folded out of the rounds. */
static inline __attribute__((always_inline)) void b2b_lanes_final(const uint64_t h0[8], u64xL t, const u64xL m[16],
                                                                  int count, uint8_t *out) {
    u64xL v[16], h[8];
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < LANES; j++) h[i][j] = h0[i];
        v[i] = h[i];
        for (int j = 0; j < LANES; j++) v[i + 8][j] = B2B_IV[i];
    }
    v[12] ^= t;
    v[14] = ~v[14];  /* every lane's block is its last */
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) B2B_ROUND(B2B_SIGMA[r]);
    for (int i = 0; i < 4; i++) {
        u64xL x = h[i] ^ v[i] ^ v[i + 8];
        for (int j = 0; j < count; j++) store64(out + 32 * j + 8 * i, x[j]);
    }
}

/* Final-block BLAKE2b-256 of `count` (<= LANES) messages of 1..128 bytes, msg[j] of len[j]
   bytes, each from state h0 after t0 bytes (see kv_b2b_256_from); digest j to out + 32 * j. */
KV_CLONES
static void b2b_256_lanes(const uint64_t h0[8], uint64_t t0, const uint8_t *const *msg, const uint64_t *len,
                          int count, uint8_t *out) {
    uint8_t blocks[LANES][128];
    u64xL m[16], t;
    memset(blocks, 0, sizeof blocks);
    for (int j = 0; j < count; j++) memcpy(blocks[j], msg[j], len[j]);
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < LANES; j++) m[i][j] = load64(blocks[j] + 8 * i);
    for (int j = 0; j < LANES; j++) t[j] = t0 + (j < count ? len[j] : 0);
    b2b_lanes_final(h0, t, m, count, out);
}

/* The same for `count` (<= LANES) consecutive 32-byte messages (key ids: the salt pass):
   12 of the 16 message words are zero, which the compiler folds out of the rounds (a quarter
   fewer operations), and the words load straight from the ids. */
KV_CLONES
static void b2b_256_lanes32(const uint64_t h0[8], uint64_t t0, const uint8_t *ids, int count, uint8_t *out) {
    u64xL m[16], t;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < LANES; j++) m[i][j] = 0;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < count; j++) m[i][j] = load64(ids + 32 * j + 8 * i);
    for (int j = 0; j < LANES; j++) t[j] = t0 + 32;
    b2b_lanes_final(h0, t, m, count, out);
}

/* Hash n messages (msg i = base + starts[i], lens[i] bytes) from state h0/t0 into out + 32 * i:
   single-block ones LANES at a time, the rest one by one. */
static void b2b_256_batch(const uint64_t h0[8], uint64_t t0, const uint8_t *base, const uint64_t *starts,
                          const uint64_t *lens, int64_t n, uint8_t *out) {
    const uint8_t *msg[LANES];
    uint64_t len[LANES];
    int64_t idx[LANES];
    uint8_t dig[LANES * 32];
    int k = 0;
    for (int64_t i = 0; i < n; i++) {
        if (lens[i] == 0 || lens[i] > 128) {
            kv_b2b_256_from(h0, t0, base + starts[i], lens[i], out + 32 * i);
            continue;
        }
        msg[k] = base + starts[i];
        len[k] = lens[i];
        idx[k++] = i;
        if (k == LANES || i == n - 1) {
            b2b_256_lanes(h0, t0, msg, len, k, dig);
            for (int j = 0; j < k; j++) memcpy(out + 32 * idx[j], dig + 32 * j, 32);
            k = 0;
        }
    }
    if (k) {
        b2b_256_lanes(h0, t0, msg, len, k, dig);
        for (int j = 0; j < k; j++) memcpy(out + 32 * idx[j], dig + 32 * j, 32);
    }
}

static void b2b_salt_from(const uint64_t keyed[8], const uint8_t *ids, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i += LANES)
        b2b_256_lanes32(keyed, 128, ids + 32 * i, n - i < LANES ? (int)(n - i) : LANES, out + 32 * i);
}

static void b2b_salt(const uint8_t *ids, int64_t n, const uint8_t *salt, size_t saltlen, uint8_t *out) {
    uint64_t keyed[8];
    b2b_256_keyed_init(keyed, salt, saltlen);
    b2b_salt_from(keyed, ids, n, out);
}

#define KV_DIGEST_CHUNK 256  /* keys whose start offsets are worked out at once */

/* Digests of keys b .. b+m-1 (m <= KV_DIGEST_CHUNK) of a packed batch, the first of them at byte *at
   of blob (advanced past them): their ids, and their salted digests when keyed (the state after
   the salt) is not NULL. */
static void kv_digest_chunk(const uint64_t plain[8], const uint64_t *keyed, const uint8_t *blob,
                            const uint64_t *lens, int64_t b, int64_t m, uint64_t *at, uint8_t *ids_out,
                            uint8_t *salted_out) {
    uint64_t starts[KV_DIGEST_CHUNK];
    for (int64_t j = 0; j < m; j++) { starts[j] = *at; *at += lens[b + j]; }
    b2b_256_batch(plain, 0, blob, starts, lens + b, m, ids_out + 32 * b);
    if (keyed) b2b_salt_from(keyed, ids_out + 32 * b, m, salted_out + 32 * b);
}

/* Client key ids of n keys concatenated in blob, key i of lens[i] bytes: ids_out[i] =
   BLAKE2b-256(key i). If salt is not NULL also salted_out[i] = BLAKE2b-256(key=salt; ids_out[i]),
   the service's digest of the key in the tenant's key space. */
void kv_key_digests(const uint8_t *blob, const uint64_t *lens, int64_t n, const uint8_t *salt,
                    size_t saltlen, uint8_t *ids_out, uint8_t *salted_out) {
    uint64_t plain[8], keyed[8], at = 0;
    b2b_256_unkeyed_init(plain);
    if (salt) b2b_256_keyed_init(keyed, salt, saltlen);
    for (int64_t b = 0; b < n; b += KV_DIGEST_CHUNK)
        kv_digest_chunk(plain, salt ? keyed : NULL, blob, lens, b, n - b < KV_DIGEST_CHUNK ? n - b : KV_DIGEST_CHUNK,
                        &at, ids_out, salted_out);
}

/* The BLAKE2b-256 state after absorbing ``salt`` (kv_worker: a connection's tenant, once). */
void kv_b2b_keyed(uint64_t *h, const uint8_t *salt, size_t saltlen) { b2b_256_keyed_init(h, salt, saltlen); }

/* The service's digests of n client key ids (32 bytes each): out[i] = BLAKE2b-256(key=salt; ids[i]). */
void kv_salt_ids(const uint8_t *ids, int64_t n, const uint8_t *salt, size_t saltlen, uint8_t *out) {
    b2b_salt(ids, n, salt, saltlen, out);
}

/* The key index (kvstore/shm/index.py; docs/FORMAT.md "Key index") as a lock-free reader sees it.
   The supervisor is its only writer. Inserts only fill empty entries or entries whose slot no
   longer holds their key, so the entry of a key that is present never changes under a reader; a
   rebuild rewrites the whole table, so it runs inside a seqlock: seq is odd while the table is
   being rewritten and grows by two per rebuild. */
/* struct kv_slot and its states: kvstore.h */
/* An entry is one u64, read and written whole: tag (bits 0..31 of d0) in the low half, the
   global slot id in the high half; all ones = empty. Home: the high half of d0 scaled to the
   capacity (any capacity below 2^32, not only powers of two). */
#define KV_EMPTY_ENTRY UINT64_MAX
#define KV_EMPTY_GID 0xFFFFFFFFu

#define KV_GROUP 32  /* keys whose memory is fetched together in a lookup */
#define KV_CHUNK 64  /* keys a client's lookup hashes before it probes them (kv_lookup_keys) */
_Static_assert(KV_CHUNK <= KV_DIGEST_CHUNK, "a lookup chunk is digested by kv_digest_chunk");


static inline uint64_t kv_home(uint64_t d0, uint64_t capacity) { return ((d0 >> 32) * capacity) >> 32; }
static inline uint64_t kv_entry(uint64_t d0, uint64_t gid) { return (uint64_t)(uint32_t)d0 | (gid << 32); }

/* The probe, in three steps so that callers can overlap the memory latency of many keys: prefetch
   each key's home entry, then (once it has arrived) the slot entry its tag points to, then probe.
   In a large store both are cache misses (the index and the slot table are tens of megabytes and
   keys land at random): taking them a key at a time would pay the latency twice per key. */
static inline void kv_prefetch_homes(const uint64_t *e, uint64_t capacity, const uint64_t *words, int64_t m,
                                     uint64_t *homes) {
    for (int64_t j = 0; j < m; j++) {
        homes[j] = kv_home(words[4 * j], capacity);
        __builtin_prefetch(&e[homes[j]]);
    }
}

static inline void kv_prefetch_slots(const uint64_t *e, const struct kv_slot *slots, uint64_t nslots,
                                     const uint64_t *words, int64_t m, const uint64_t *homes) {
    for (int64_t j = 0; j < m; j++) {
        uint64_t v = __atomic_load_n(&e[homes[j]], __ATOMIC_RELAXED);
        uint32_t g = (uint32_t)(v >> 32);
        if (g < nslots && (uint32_t)v == (uint32_t)words[4 * j]) {
            __builtin_prefetch(&slots[g]);
            __builtin_prefetch((const char *)&slots[g] + sizeof(struct kv_slot) - 1);
        }
    }
}

/* out[j] = the slot holding digest words[j] or -1, for m keys whose homes are known; sets the
   reference bit of each hit (ref not NULL). Returns the hits. */
static inline int64_t kv_probe(const uint64_t *e, uint64_t capacity, const struct kv_slot *slots, uint64_t nslots,
                               const uint64_t *words, int64_t m, const uint64_t *homes, int64_t *out,
                               uint8_t *ref) {
    int64_t hits = 0;
    for (int64_t j = 0; j < m; j++) {
        const uint64_t *w = words + 4 * j;
        uint64_t p = homes[j];
        uint32_t tag = (uint32_t)w[0];
        int64_t found = -1;
        for (uint64_t probe = 0; probe < capacity; probe++) {
            uint64_t v = __atomic_load_n(&e[p], __ATOMIC_RELAXED);
            uint32_t g = (uint32_t)(v >> 32);
            if (g == KV_EMPTY_GID) break;
            if ((uint32_t)v == tag && g < nslots) {
                const struct kv_slot *s = &slots[g];
                if (__atomic_load_n(&s->state, __ATOMIC_RELAXED) == KV_SLOT_VALID && s->d[0] == w[0]
                    && s->d[1] == w[1] && s->d[2] == w[2] && s->d[3] == w[3]) {
                    found = g;
                    break;
                }
            }
            if (++p == capacity) p = 0;
        }
        out[j] = found;
        if (found >= 0) {
            hits++;
            if (ref) __atomic_store_n(&ref[found], 1, __ATOMIC_RELAXED);
        }
    }
    return hits;
}

/* kv_probe for n keys, a group at a time: the group's home entries fetched together, then
   their slots, then probed (the three steps above). */
static inline int64_t kv_lookup_words(const uint64_t *e, uint64_t capacity, const struct kv_slot *slots,
                                      uint64_t nslots, const uint64_t *words, int64_t n, int64_t *out,
                                      uint8_t *ref) {
    uint64_t homes[KV_GROUP];
    int64_t hits = 0;
    for (int64_t base = 0; base < n; base += KV_GROUP) {
        int64_t m = n - base < KV_GROUP ? n - base : KV_GROUP;
        const uint64_t *w = words + 4 * base;
        kv_prefetch_homes(e, capacity, w, m, homes);
        kv_prefetch_slots(e, slots, nslots, w, m, homes);
        hits += kv_probe(e, capacity, slots, nslots, w, m, homes, out + base, ref);
    }
    return hits;
}

/* The reader's side of the seqlock around a lookup: its start (0: a rebuild is under way) and
   whether nothing it read can have been torn by one. */
static inline uint64_t kv_read_begin(const uint64_t *seq) {
    uint64_t s0 = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
    return (s0 & 1) ? 0 : s0 | (1ULL << 63);
}

static inline int kv_read_valid(const uint64_t *seq, uint64_t begun) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(seq, __ATOMIC_RELAXED) == (begun & ~(1ULL << 63));
}

/* out[i] = global slot id holding digest words[i] (4 x u64), or -1. A hit sets ref[gid] = 1
   (the CLOCK reference bit: a page asked about is recently used) when ref is not NULL.
   Returns the number of hits, or -1 when the table was being rebuilt during the call (seq odd or
   changed): nothing in out can be trusted then, the caller retries or asks the service. A hit is
   a hint, as every lookup is: a get validates the page itself. */
int64_t kv_index_lookup(const uint64_t *seq, const void *entries, uint64_t capacity, const void *slotsv,
                        uint64_t nslots, const uint64_t *words, int64_t n, int64_t *out, uint8_t *ref) {
    const uint64_t *e = entries;
    const struct kv_slot *slots = slotsv;
    uint64_t begun = kv_read_begin(seq);
    if (!begun) return -1;
    int64_t hits = kv_lookup_words(e, capacity, slots, nslots, words, n, out, ref);
    return kv_read_valid(seq, begun) ? hits : -1;
}

/* A client's whole lookup in one call: the key ids, the salted digests and the index probe of n
   keys concatenated in blob (key i of lens[i] bytes). ids_out[i] and words_out[i] get the two
   digests (as kv_key_digests), out[i] the slot holding key i or -1. stop_at_miss: a prefix
   lookup needs nothing after its first miss, so the call stops after the chunk of KV_CHUNK keys
   that holds it (hashing is most of a lookup's time); *done gets how many keys have out[] filled
   (n unless it stopped). Returns the hits among them, or -1 when a rebuild of the index overlapped
   (retry). Measured at 10^6 slots, A/B in one process: a full lookup costs what hashing the
   whole batch and then probing it did (122 vs 121 us); prefetching a group's entries while the
   next group is hashed hid none of the memory latency on the machine measured (docs/BENCHMARKS.md),
   so the chunk is there only to bound the hashing after a first miss. */
int64_t kv_lookup_keys(const uint8_t *blob, const uint64_t *lens, int64_t n, const uint8_t *salt,
                       size_t saltlen, const uint64_t *seq, const void *entries, uint64_t capacity,
                       const void *slotsv, uint64_t nslots, int stop_at_miss, uint8_t *ids_out,
                       uint64_t *words_out, int64_t *out, uint8_t *ref, int64_t *done) {
    const uint64_t *e = entries;
    const struct kv_slot *slots = slotsv;
    uint64_t plain[8], keyed[8], at = 0;
    int64_t hits = 0, b = 0;
    *done = 0;
    uint64_t begun = kv_read_begin(seq);
    if (!begun) return -1;
    b2b_256_unkeyed_init(plain);
    b2b_256_keyed_init(keyed, salt, saltlen);
    while (b < n) {
        int64_t m = n - b < KV_CHUNK ? n - b : KV_CHUNK, h;
        kv_digest_chunk(plain, keyed, blob, lens, b, m, &at, ids_out, (uint8_t *)words_out);
        h = kv_lookup_words(e, capacity, slots, nslots, words_out + 4 * b, m, out + b, ref);
        hits += h;
        b += m;
        if (stop_at_miss && h < m) break;
    }
    *done = b;
    return kv_read_valid(seq, begun) ? hits : -1;
}

/* The writer's insert (kvstore/shm/index.py KeyIndex.insert_many): index slot gids[i] under
   digest first word d0s[i], in batch order. Each takes the first entry on its probe path that is
   empty, garbage (its slot is not VALID or holds another key) or already its own: so the entry of
   a present key never changes under a reader. The slot must be VALID with its digest before its
   entry is published (store-release). Returns the entries that were empty before (the caller's
   count of used entries grows by that), or -1 if a probe found no room (a full table: the caller
   rebuilds it at 3/4, so only with a wrong capacity). */
int64_t kv_index_insert(void *entries, uint64_t capacity, const void *slots, uint64_t nslots,
                        const uint64_t *d0s, const int64_t *gids, int64_t n) {
    uint64_t *e = entries;
    const struct kv_slot *s = slots;
    int64_t fresh = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t g = (uint64_t)gids[i], p = kv_home(d0s[i], capacity), probe = 0;
        if (g >= nslots) return -1;
        for (;; probe++) {
            if (probe == capacity) return -1;
            uint64_t v = e[p];
            uint32_t eg = (uint32_t)(v >> 32);
            if (v == KV_EMPTY_ENTRY) { fresh++; break; }
            if (eg == g || eg >= nslots || s[eg].state != KV_SLOT_VALID || (uint32_t)s[eg].d[0] != (uint32_t)v) break;
            if (++p == capacity) p = 0;
        }
        __atomic_store_n(&e[p], kv_entry(d0s[i], g), __ATOMIC_RELEASE);
    }
    return fresh;
}

/* Writer side of the seqlock: begin makes seq odd before the table is touched, end makes it
   even after every store to the table is visible. */
void kv_seq_begin(uint64_t *seq) {
    __atomic_store_n(seq, __atomic_load_n(seq, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

void kv_seq_end(uint64_t *seq) {
    __atomic_store_n(seq, __atomic_load_n(seq, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
}

/* Index every VALID slot of the slot table into an index table that was just emptied (every
   entry KV_EMPTY_ENTRY): the supervisor's rebuild, one pass in slot order with no temporaries (at 10^7 slots the
   vectorized Python path needs seconds and gigabytes). Returns the entries used, or -1 if the
   table is full (it is sized for 7/4 of the slots, so only with a wrong capacity). */
int64_t kv_index_fill(void *entries, uint64_t capacity, const void *slots, uint64_t nslots) {
    uint64_t *e = entries;
    const struct kv_slot *s = slots;
    int64_t used = 0;
    if (nslots > KV_EMPTY_GID) return -1;
    for (uint64_t g = 0; g < nslots; g++) {
        if (s[g].state != KV_SLOT_VALID) continue;
        uint64_t p = kv_home(s[g].d[0], capacity), probe = 0;
        while (__atomic_load_n(&e[p], __ATOMIC_RELAXED) != KV_EMPTY_ENTRY) {
            if (++probe == capacity) return -1;
            if (++p == capacity) p = 0;
        }
        __atomic_store_n(&e[p], kv_entry(s[g].d[0], g), __ATOMIC_RELAXED);
        used++;
    }
    return used;
}
