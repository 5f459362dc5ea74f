"""cffi build script for ``kvstore.ioworkers._aio``: libaio and the shm atomics.

Compiled out-of-line at install time (``setup.py`` names it in ``cffi_modules``),
so importing kvstore never needs a compiler. ``kvstore/ioworkers/aio.py`` is the
only module that touches the compiled library; it gives the functions typed
signatures and turns negative return values into ``OSError``.

Why C helpers instead of calling ``io_prep_pread`` & co. from Python: one
crossing of the cffi boundary per batch, not per field, keeps the per-I/O
software cost small next to a 4 KiB..16 MiB transfer.

The atomics exist because the shm rings are read and written by different
processes: a plain store of the tail index could become visible before the
record it publishes on weakly ordered CPUs (aarch64). ``__atomic`` builtins with
acquire/release order are exactly what the ring protocol needs, and compile to
plain loads/stores on x86_64.
"""

from __future__ import annotations

from pathlib import Path

import cffi

CDEF = """
typedef struct io_context *io_context_t;
struct iocb { ...; };
struct io_event { ...; };

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

void kv_key_digests(const uint8_t *blob, const uint64_t *lens, int64_t n, const uint8_t *salt,
                    size_t saltlen, uint8_t *ids_out, uint8_t *salted_out);
void kv_salt_ids(const uint8_t *ids, int64_t n, const uint8_t *salt, size_t saltlen, uint8_t *out);
void kv_b2b_keyed(uint64_t *h, const uint8_t *salt, size_t saltlen);
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
uint64_t kv_copy_sum(uint8_t *dst, const uint8_t *src, size_t n);
uint64_t kv_xxh3(const uint8_t *p, size_t n);
"""
# the I/O worker's structures, declared once for C and cffi alike (see the file)
WORKER_H = Path(__file__).with_name("_worker.h").read_text()
CDEF += WORKER_H + """
int kv_wk_init(struct kv_worker *w);
void kv_wk_free(struct kv_worker *w);
int kv_wk_turn(struct kv_worker *w);
int kv_wk_reap(struct kv_worker *w, int min_nr, int64_t timeout_ns);
void kv_wk_layout(int64_t *out);
"""

SOURCE = r"""
#include <libaio.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <stddef.h>

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
"""
# key digests (BLAKE2b) and the lock-free key-index reader: their own file, for their own concern
SOURCE += Path(__file__).with_name("_keys.c").read_text()
# the I/O worker's per-I/O path (uses _keys.c's load64/store64)
SOURCE += WORKER_H + Path(__file__).with_name("_worker.c").read_text()
# a client's page copied into its buffer, checksummed on the way
SOURCE += Path(__file__).with_name("_copy.c").read_text()

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "kvstore.ioworkers._aio",
    SOURCE,
    libraries=["aio", "xxhash"],
    extra_compile_args=["-O2", "-std=gnu11"],
)

if __name__ == "__main__":  # pragma: no cover - manual rebuild: python kvstore/ioworkers/_aio_build.py
    ffibuilder.compile(verbose=True)
