/* libaio and the shared-memory atomics, a unit of kvstore._native._lib.

   Why C helpers instead of calling io_prep_pread & co. from Python: one crossing of the cffi
   boundary per batch, not per field, keeps the per-I/O software cost small next to a
   4 KiB..16 MiB transfer. The atomics exist because the shm rings are read and written by
   different processes: a plain store of the tail index could become visible before the record
   it publishes on weakly ordered CPUs (aarch64). __atomic builtins with acquire/release order
   are exactly what the ring protocol needs, and compile to plain loads/stores on x86_64. */

#include "internal.h"
int kv_io_setup(unsigned nr, io_context_t *ctx) { *ctx = 0; return io_setup(nr, ctx); }
int kv_io_destroy(io_context_t ctx) { return io_destroy(ctx); }
size_t kv_iocb_size(void) { return sizeof(struct iocb); }

/* Prepare n iocbs (op 0 = pread, 1 = pwrite) and submit them in one call.
   Returns the number submitted or -errno. The caller owns iocbs/ptrs memory,
   which must stay alive until the matching completion is reaped. */
int kv_submit(io_context_t ctx, struct iocb *iocbs, struct iocb **ptrs, int n,
              const int *fds, const int *ops, char *const *bufs,
              const unsigned long long *lens, const long long *offs,
              const unsigned long long *tags)
{
    for (int i = 0; i < n; i++) {
        if (ops[i] == 0)
            io_prep_pread(&iocbs[i], fds[i], bufs[i], (size_t)lens[i], offs[i]);
        else
            io_prep_pwrite(&iocbs[i], fds[i], bufs[i], (size_t)lens[i], offs[i]);
        iocbs[i].data = (void *)(uintptr_t)tags[i];
        ptrs[i] = &iocbs[i];
    }
    int done = 0;
    while (done < n) {
        int r = io_submit(ctx, n - done, ptrs + done);
        if (r == -EINTR || r == -EAGAIN) { if (done) break; continue; }
        if (r < 0) return done ? done : r;
        if (r == 0) break;
        done += r;
    }
    return done;
}

/* Reap between min_nr and max_nr completions, waiting at most timeout_ns.
   tags_out[i] is the iocb's tag; res_out[i] the byte count or -errno. */
int kv_getevents(io_context_t ctx, int min_nr, int max_nr, long long timeout_ns,
                 unsigned long long *tags_out, long long *res_out)
{
    struct io_event ev[256];
    if (max_nr > 256) max_nr = 256;
    if (min_nr > max_nr) min_nr = max_nr;
    struct timespec ts;
    ts.tv_sec = timeout_ns / 1000000000LL;
    ts.tv_nsec = timeout_ns % 1000000000LL;
    int r;
    do { r = io_getevents(ctx, min_nr, max_nr, ev, timeout_ns < 0 ? NULL : &ts); } while (r == -EINTR);
    if (r < 0) return r;
    for (int i = 0; i < r; i++) {
        tags_out[i] = (unsigned long long)(uintptr_t)ev[i].data;
        /* res is unsigned long in the ABI; a negative errno shows up as a huge value. */
        res_out[i] = (long long)(long)ev[i].res;
    }
    return r;
}

uint64_t kv_load_acquire_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void kv_store_release_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
uint32_t kv_load_acquire_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void kv_store_release_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
int kv_cas_u32(uint32_t *p, uint32_t expected, uint32_t desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
uint64_t kv_fetch_add_u64(uint64_t *p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
/* A full fence: the two sides of a pin (a reader's "pin, then check the slot" against the
   supervisor's "retire, then check the pins") each need their store ordered before their load. */
void kv_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
/* Whether v is among a[0..n) (volatile loads: other processes write a; the caller fences first). */
int kv_contains_i64(const int64_t *a, int64_t n, int64_t v) {
    const volatile int64_t *x = a;
    for (int64_t i = 0; i < n; i++) if (x[i] == v) return 1;
    return 0;
}

/* Hand several buffers on at once: a store-release of ``v`` into base[idx[i]] for each i (a
   client's lease states; one call where Python would make one per buffer). */
void kv_store_release_u32_at(uint32_t *base, const int64_t *idx, int64_t n, uint32_t v) {
    for (int64_t i = 0; i < n; i++) __atomic_store_n(&base[idx[i]], v, __ATOMIC_RELEASE);
}

/* Take the answers to a client's direct reads that have come: read i (key row rows[i], lease
   buffer bufs[i], seq seqs[i]) is answered when its buffer is in state ``want`` (handed back)
   and its answer word holds its seq (load-acquire each, so the status and the page written
   before them are seen); then good[rows[i]] = its status is OK. The reads still waiting are
   moved to the front of the three arrays, in order; returns how many. */
int64_t kv_take_landed(const uint32_t *states, const uint64_t *wseq, const int32_t *wstat, int64_t *rows,
                       int64_t *bufs, uint64_t *seqs, int64_t n, uint32_t want, int32_t ok, uint8_t *good) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = bufs[i];
        if (__atomic_load_n(&states[b], __ATOMIC_ACQUIRE) == want
                && __atomic_load_n(&wseq[b], __ATOMIC_ACQUIRE) == seqs[i]) {
            good[rows[i]] = wstat[b] == ok;
        } else {
            rows[k] = rows[i];
            bufs[k] = b;
            seqs[k] = seqs[i];
            k++;
        }
    }
    return k;
}
