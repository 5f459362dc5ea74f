/* The I/O worker's structures (ioworkers/_worker.c), in one place for both the C source and
   cffi's declarations (kvstore/ioworkers/_aio_build.py reads this file into both), so the
   two cannot disagree. Plain declarations only: cffi parses them. The record structs are the
   numpy dtypes of ipc/iorings.py and ipc/connection.py (tests compare the offsets). */

struct kv_io_request {  /* IO_REQUEST, 112 bytes */
    uint64_t tag; uint32_t op, buf; uint64_t offset, length, gen, d[4];
    uint32_t area, flags; uint64_t slot, payload_len, csum, conn_gen;
};
struct kv_direct_request {  /* DIRECT_REQ, 64 bytes */
    uint64_t seq; uint16_t buf, area; uint32_t payload_len; uint64_t slot, gen, d[4];
};
struct kv_completion {  /* IO_COMPLETION, 48 bytes */
    uint64_t tag; int64_t result; int32_t status; uint32_t kind; uint64_t latency_ns, gen, where;
};

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
    int32_t cid;           /* its id in the service's connection table */
    int32_t refused;       /* it posted a record no honest client writes: no more of its reads */
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
