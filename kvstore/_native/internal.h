/* What every C unit of kvstore._native._lib includes: the system headers, kvstore.h (the
   declarations shared with Python), and the small inline helpers the units share. C only:
   cffi never reads this file. */
#ifndef KV_INTERNAL_H
#define KV_INTERNAL_H

#include <libaio.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>

/* xxh3 from libxxhash, on x86_64 through its runtime dispatch, which picks AVX-512 or AVX2
   where the CPU has them: 1 MiB in ~25 us hot / ~100 us cold here, against ~57 / ~160 us for
   the SSE2 code a plain build (or an inlined copy of the header) gets. */
#define XXH_STATIC_LINKING_ONLY  /* XXH3_state_t on the stack (kv_copy_sum) */
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#define KV_XXH3 XXH3_64bits_dispatch
#define KV_XXH3_UPDATE XXH3_64bits_update_dispatch
#else
#define KV_XXH3 XXH3_64bits
#define KV_XXH3_UPDATE XXH3_64bits_update
#endif

#include "kvstore.h"

_Static_assert(sizeof(struct kv_slot_header) == 128, "slot header fields: 128 bytes");
_Static_assert(offsetof(struct kv_slot_header, hcsum) == KV_FIELDS_SIZE, "header checksum after the fields");
_Static_assert(sizeof(struct kv_slot) == 48, "slot entry: 48 bytes");
_Static_assert(sizeof(struct kv_io_request) == 112, "IO_REQUEST: 112 bytes");
_Static_assert(sizeof(struct kv_direct_request) == 64, "DIRECT_REQ: 64 bytes");
_Static_assert(sizeof(struct kv_completion) == 48, "IO_COMPLETION: 48 bytes");

/* little-endian loads and stores at any alignment (headers are on-device bytes) */
static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline void store32(uint8_t *p, uint32_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

/* a slot header field's offset in the header block */
#define KV_H(field) offsetof(struct kv_slot_header, field)

#endif
