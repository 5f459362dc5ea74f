/* kvstore's compiled core: every structure and constant shared between C units, and between
   C and Python, declared once.

   cffi reads this file as it is (build.py), so it holds plain declarations only: structs,
   integer #defines and prototypes, no #include, no expressions. Each C unit includes it
   through internal.h (which includes libaio.h first, for io_context_t and struct iocb).
   Python takes the constants from the compiled module (``kvstore._native.lib.LIB.KV_*``),
   and tests/native/test_layout.py checks every record struct against its numpy dtype and the
   slot header against storage/header.py's field list, so a field changed here fails a test
   until Python and docs/FORMAT.md agree. */

/* ---- the slot header (storage/header.py; docs/FORMAT.md "Slot header") ---------------------- */
#define KV_HEADER_BLOCK 4096   /* the header block before every payload */
#define KV_FIELDS_SIZE 120     /* bytes the header checksum covers */
#define KV_FORMAT_VERSION 1    /* storage/superblock.py FORMAT_VERSION */
struct kv_slot_header {        /* the block's first 128 bytes, little-endian, the rest zero */
    uint8_t magic[8];          /* "KVSTSLOT" */
    uint32_t version, flags;
    uint8_t store_uuid[16];
    uint32_t device, area;
    uint64_t slot, gen;
    uint64_t d[4];             /* the salted key digest */
    uint64_t length, csum, written_ns, reserved;
    uint64_t hcsum;            /* xxh3_64 of bytes [0, KV_FIELDS_SIZE) */
};

/* ---- the slot table (shm/slots.py SLOT_DTYPE; docs/FORMAT.md "Slot table") ------------------ */
#define KV_SLOT_EMPTY 0
#define KV_SLOT_WRITING 1
#define KV_SLOT_VALID 2
#define KV_SLOT_RETIRED 3
struct kv_slot { uint64_t gen, d[4]; uint32_t length; uint8_t state, pad[3]; };  /* 48 bytes */

/* ---- a lease's buffer states (ipc/lease.py) ------------------------------------------------- */
#define KV_A_FREE 0
#define KV_A_CLIENT 1
#define KV_A_SERVICE 2
#define KV_A_QUARANTINE 3
#define KV_A_DIRECT 4
#define KV_A_READING 5

/* ---- worker rings (ipc/iorings.py) ---------------------------------------------------------- */
#define KV_OP_READ 0
#define KV_OP_WRITE 1
#define KV_F_CSUM 1            /* write: the client computed the payload checksum */
#define KV_ST_OK 0
#define KV_ST_IO_ERROR 1
#define KV_ST_BAD_HEADER 2
#define KV_ST_BAD_CHECKSUM 3
#define KV_ST_WORKER_LOST 4    /* the supervisor's: the worker died or hung */
#define KV_ST_REFUSED 5        /* a direct-read record no honest client writes: nothing read */
#define KV_ST_STALE 6          /* the slot no longer holds the page the client found: a miss */
#define KV_K_SUPERVISOR 0
#define KV_K_DIRECT 1
#define KV_MAX_DEPTH 4096      /* I/O slots of a worker at most; also its pins (WPINS) */
#define KV_NBAD 16

struct kv_io_request {  /* IO_REQUEST, 112 bytes */
    uint64_t tag; uint32_t op, buf; uint64_t offset, length, gen, d[4];
    uint32_t area, flags; uint64_t slot, payload_len, csum, conn_gen;
};
struct kv_direct_request {  /* DIRECT_REQ of ipc/connection.py, 64 bytes */
    uint64_t seq; uint16_t buf, area; uint32_t payload_len; uint64_t slot, gen, d[4];
};
struct kv_completion {  /* IO_COMPLETION, 48 bytes */
    uint64_t tag; int64_t result; int32_t status; uint32_t kind; uint64_t latency_ns, gen, where;
};

/* ---- the I/O worker (worker.c; ioworkers/worker.py fills and reads it) ---------------------- */
struct kv_ring { uint64_t *head; uint64_t *tail; uint8_t *recs; uint64_t mask; };

struct kv_wconn {
    int32_t live;          /* in the connection table: its ring is served */
    int32_t wake;          /* on the wake list of this turn */
    uint32_t gen, lease_start, lease_count;
    struct kv_ring ring;   /* its direct reads for this device (the client writes head and tail) */
    uint8_t *base;         /* its lease's buffers, in its segment as this worker maps it */
    uint32_t *states;      /* its lease's state words */
    uint64_t head;         /* the worker's own consumer index: the shared head word is only a copy */
    int64_t *pins; uint64_t *dseq; int32_t *wstat; uint64_t *wseq;
    int64_t inflight;
    int64_t *busy;         /* the worker's table: buffers of this lease it reads into or is taking */
    uint64_t keyed[8];     /* BLAKE2b state after the connection's tenant salt (from the service) */
    uint64_t keyed_prev[8]; /* ... after the salt it replaced (an invalidate), if has_prev */
    int32_t has_prev;
    int32_t cid;           /* its id in the service's connection table */
    int32_t refused;       /* it posted a record no honest client writes: no more of its reads */
    uint64_t *wake_seq;    /* client: the read it waits for next (also woken for it: pipelined gets) */
};

struct kv_bad {  /* a read whose header was not the expected one, for the log */
    uint32_t area, decoded, key_matches, _pad;
    uint64_t slot, expected_gen, found_gen, expected_len, found_len, found_slot;
};

struct kv_pend {
    struct kv_io_request r;
    int64_t t0;    /* submit time, CLOCK_MONOTONIC ns; 0 while the slot is free */
    uint8_t *bufp; /* the buffer, as this worker maps it */
    int32_t conn;  /* -1: the supervisor's request; else the connection slot */
    uint32_t b;
    uint64_t seq;
};

struct kv_worker {
    /* set by Python before kv_wk_init */
    int fd, read_depth, max_writes, version;
    struct kv_ring reads, writes, done;
    uint64_t bsize;              /* bytes per buffer: 4096 + page size */
    uint8_t **lease_base;        /* by connection id: its buffers as mapped here, NULL: none */
    uint32_t *lease_gen;         /* by connection id: the generation lease_base belongs to */
    const uint64_t *table;       /* the worker's connection table (WCONN: gen in word 0 of 8) */
    uint32_t per_lease, nleases; /* buffers per lease, connection ids */
    uint8_t uuid[16]; uint32_t dev; uint64_t page_size, slot_size;
    const uint64_t *area_off; const uint64_t *area_slots; uint32_t n_areas;
    uint32_t own_area;           /* the only area this server writes */
    const void *slots;           /* the slot table (struct kv_slot): what a direct read is checked against */
    const uint64_t *area_gid;    /* global slot id of each area's slot 0 on this device */
    uint8_t *ref;                /* CLOCK reference bits, set for each page a client read */
    int64_t *wpins;              /* by I/O slot: the slot (gid) a direct read in it pins, -1 none
                                    (the worker's segment; the supervisor reuses no slot pinned here) */
    uint64_t *row; int32_t didx[12]; uint64_t *hread, *hwrite; int32_t hist_buckets;
    struct kv_wconn *conns; int32_t nconn;
    /* read and reset by Python after each call */
    int32_t bell, nwake, nbad;
    int32_t need_attach;         /* a request named a connection not attached yet: follow the table */
    int32_t *wake_list;
    struct kv_bad bad[16];
    uint64_t reports_dropped;
    uint64_t refused;            /* direct-read records refused (a lie, or an inconsistent ring) */
    /* state */
    int64_t outstanding, reads_inflight, writes_inflight;
    int32_t depth, nfree, ndeferred, rr;
    uint64_t next_direct;
    int64_t writes_waiting_since;  /* CLOCK_MONOTONIC ns since writes wait behind reads; 0: none */
    io_context_t ctx;
    struct iocb *iocbs; struct iocb **ptrs; struct kv_pend *pend; int32_t *free_slots;
    struct kv_completion *deferred;
};

/* ---- aio.c: libaio, shared-memory atomics ----------------------------------------------------- */
int kv_io_setup(unsigned nr, io_context_t *ctx);
int kv_io_destroy(io_context_t ctx);
int kv_submit(io_context_t ctx, struct iocb *iocbs, struct iocb **ptrs, int n,
              const int *fds, const int *ops, char *const *bufs,
              const unsigned long long *lens, const long long *offs,
              const unsigned long long *tags);
int kv_getevents(io_context_t ctx, int min_nr, int max_nr, long long timeout_ns,
                 unsigned long long *tags_out, long long *res_out);
size_t kv_iocb_size(void);
uint64_t kv_load_acquire_u64(const uint64_t *p);
void kv_store_release_u64(uint64_t *p, uint64_t v);
uint32_t kv_load_acquire_u32(const uint32_t *p);
void kv_store_release_u32(uint32_t *p, uint32_t v);
int kv_cas_u32(uint32_t *p, uint32_t expected, uint32_t desired);
uint64_t kv_fetch_add_u64(uint64_t *p, uint64_t v);
void kv_fence(void);
int kv_contains_i64(const int64_t *a, int64_t n, int64_t v);
void kv_store_release_u32_at(uint32_t *base, const int64_t *idx, int64_t n, uint32_t v);
int64_t kv_take_landed(const uint32_t *states, const uint64_t *wseq, const int32_t *wstat, int64_t *rows,
                       int64_t *bufs, uint64_t *seqs, int64_t n, uint32_t want, int32_t ok, uint8_t *good);

/* ---- direct.c: a client's direct reads, posted ------------------------------------------------ */
int64_t kv_post_direct(const void *slotsv, uint64_t nslots, const int64_t *gids, const uint64_t *words,
                       const uint64_t *ids, const int64_t *bufs, int64_t n, int64_t *pins, uint64_t *dseq,
                       uint32_t *ddev, uint32_t *states, uint32_t direct_state, const int64_t *bases,
                       int64_t nbases, int64_t nareas, struct kv_ring *rings, int64_t ndev, uint64_t *seq,
                       int64_t *rows_out, int64_t *lbs_out, uint64_t *seqs_out, uint8_t *woken);

/* ---- keys.c: key digests (BLAKE2b) and the lock-free key index -------------------------------- */
void kv_key_digests(const uint8_t *blob, const uint64_t *lens, int64_t n, const uint8_t *salt,
                    size_t saltlen, uint8_t *ids_out, uint8_t *salted_out);
void kv_salt_ids(const uint8_t *ids, int64_t n, const uint8_t *salt, size_t saltlen, uint8_t *out);
void kv_b2b_keyed(uint64_t *h, const uint8_t *salt, size_t saltlen);
void kv_b2b_256_from(const uint64_t *h0, uint64_t t0, const uint8_t *msg, size_t len, uint8_t *out);
int64_t kv_index_lookup(const uint64_t *seq, const void *entries, uint64_t capacity, const void *slots,
                        uint64_t nslots, const uint64_t *words, int64_t n, int64_t *out, uint8_t *ref);
int64_t kv_lookup_keys(const uint8_t *blob, const uint64_t *lens, int64_t n, const uint8_t *salt,
                       size_t saltlen, const uint64_t *seq, const void *entries, uint64_t capacity,
                       const void *slots, uint64_t nslots, int stop_at_miss, uint8_t *ids_out,
                       uint64_t *words_out, int64_t *out, uint8_t *ref, int64_t *done);
int64_t kv_index_fill(void *entries, uint64_t capacity, const void *slots, uint64_t nslots);
int64_t kv_index_insert(void *entries, uint64_t capacity, const void *slots, uint64_t nslots,
                        const uint64_t *d0s, const int64_t *gids, int64_t n);
void kv_seq_begin(uint64_t *seq);
void kv_seq_end(uint64_t *seq);

/* ---- worker.c: one turn of an I/O worker ------------------------------------------------------ */
int kv_wk_init(struct kv_worker *w);
void kv_wk_free(struct kv_worker *w);
int kv_wk_turn(struct kv_worker *w);
int kv_wk_reap(struct kv_worker *w, int min_nr, int64_t timeout_ns);

/* ---- copy.c: a page copied into its buffer, checksummed on the way ---------------------------- */
uint64_t kv_copy_sum(uint8_t *dst, const uint8_t *src, size_t n);
uint64_t kv_xxh3(const uint8_t *p, size_t n);
