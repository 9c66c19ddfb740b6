/*
 * doorbell_ring.h — the same-host doorbell's shared-memory layout (ring version 1), shared
 * by libdetattn (plugin/doorbell.c, which creates rings) and detattnd (server/doorbell.c,
 * which serves them). Part of the wire protocol: change it only with a new version.
 *
 * A ring is a memfd sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW |
 * F_SEAL_SEAL) of exactly da_ring_bytes(slots, request_bytes, reply_bytes) bytes:
 *
 *   [header: DA_RING_HDR_BYTES] [slot 0] [slot 1] ... [slot slots-1] [zero padding to a page]
 *   slot: [slot header: DA_RING_SLOT_HDR_BYTES] [request area] [reply area]
 *
 * Each slot carries one call at a time: a packed detattn.v1.Request in its request area
 * (req_len bytes), then the packed detattn.v1.Response in its reply area (rep_len bytes).
 * Every word below is 32-bit, little-endian, and accessed with atomics by both sides.
 *
 * A slot's state word, and who moves it:
 *   FREE    -> CLAIMED  client (CAS): one thread of the client owns the slot
 *   CLAIMED -> REQUEST  client (seq_cst store), after writing req_len and the request
 *   REQUEST -> TAKEN    daemon (CAS), then it copies the request out before decoding it
 *   REQUEST -> FREE     client (CAS) withdrawing a call not taken yet (its deadline passed)
 *   REQUEST, TAKEN -> LOST  client (CAS), when its connection to the daemon dropped
 *   TAKEN   -> DONE     daemon (seq_cst store), after writing rep_len and the reply
 *   DONE    -> FREE     client, after copying the reply out
 * The daemon trusts none of it: it keeps its own record of which slots it holds, copies a
 * request before looking at it, checks every length, and a slot in any other state is not
 * its business. Whatever a client writes here can only break that client's own calls.
 *
 * Wake-ups, both ways Dekker-style (a store then a load of the other side's word, both
 * seq_cst, so at least one side sees the other and no wake-up is lost):
 *  - the daemon sets header.sleeping before it rescans the ring once and sleeps; a client
 *    publishes REQUEST, then reads sleeping and, when it is set, writes 1 to the ring's
 *    eventfd (handed over with the memfd);
 *  - a client thread that stops spinning sets its slot's waiting word, re-reads state, and
 *    sleeps with FUTEX_WAIT (shared, not FUTEX_PRIVATE) on the state word; the daemon
 *    publishes DONE, then reads waiting and, when it is set, calls FUTEX_WAKE on the state.
 */
#ifndef DA_DOORBELL_RING_H
#define DA_DOORBELL_RING_H

#include <stddef.h>
#include <stdint.h>

#define DA_RING_MAGIC 0x42444144u /* "DADB": the header's magic and the side socket's hand-over */
#define DA_RING_VERSION 1u
#define DA_RING_HDR_BYTES 128u
#define DA_RING_SLOT_HDR_BYTES 64u
#define DA_RING_PAGE 4096u
/* Geometry a daemon accepts: areas are multiples of 64 bytes in [MIN_AREA, MAX_AREA]. */
#define DA_RING_MAX_SLOTS 1024u
#define DA_RING_MIN_AREA 1024u
#define DA_RING_MAX_AREA (1u << 20)

enum da_ring_state {
  DA_RING_FREE = 0,
  DA_RING_CLAIMED = 1,
  DA_RING_REQUEST = 2,
  DA_RING_TAKEN = 3,
  DA_RING_DONE = 4,
  DA_RING_LOST = 5,
};

/* The first DA_RING_HDR_BYTES of the ring. The client writes the first line once before the
 * hand-over (the daemon reads it once, there, and keeps the geometry it registered); the
 * daemon writes sleeping, on its own cache line. */
typedef struct da_ring_hdr {
  uint32_t magic, version, slots, request_bytes, reply_bytes;
  uint32_t reserved[11];
  uint32_t sleeping; /* daemon: 1 while it does not scan this ring (write the eventfd) */
  uint32_t reserved2[15];
} da_ring_hdr;

/* The first DA_RING_SLOT_HDR_BYTES of a slot. */
typedef struct da_ring_slot {
  uint32_t state;   /* enum da_ring_state; the futex word */
  uint32_t waiting; /* client: 1 while a thread sleeps on state */
  uint32_t req_len; /* client: bytes of the request, at most request_bytes */
  uint32_t rep_len; /* daemon: bytes of the reply, at most reply_bytes */
  uint32_t reserved[12];
} da_ring_slot;

_Static_assert(sizeof(da_ring_hdr) == DA_RING_HDR_BYTES, "ring header layout");
_Static_assert(sizeof(da_ring_slot) == DA_RING_SLOT_HDR_BYTES, "ring slot header layout");

/* 1 when the geometry is one a daemon accepts. */
static inline int da_ring_geometry_ok(uint32_t slots, uint32_t request_bytes, uint32_t reply_bytes) {
  return slots >= 1 && slots <= DA_RING_MAX_SLOTS && request_bytes >= DA_RING_MIN_AREA &&
         request_bytes <= DA_RING_MAX_AREA && request_bytes % 64 == 0 && reply_bytes >= DA_RING_MIN_AREA &&
         reply_bytes <= DA_RING_MAX_AREA && reply_bytes % 64 == 0;
}

/* Bytes from one slot's start to the next's. */
static inline size_t da_ring_slot_stride(uint32_t request_bytes, uint32_t reply_bytes) {
  return (size_t)DA_RING_SLOT_HDR_BYTES + request_bytes + reply_bytes;
}

/* The ring's size: header and slots, rounded up to a page. Geometry must be ok. */
static inline uint64_t da_ring_bytes(uint32_t slots, uint32_t request_bytes, uint32_t reply_bytes) {
  uint64_t n = DA_RING_HDR_BYTES + (uint64_t)slots * da_ring_slot_stride(request_bytes, reply_bytes);
  return (n + DA_RING_PAGE - 1) / DA_RING_PAGE * DA_RING_PAGE;
}

/* Slot i's header; its request area follows it, then its reply area. */
static inline da_ring_slot *da_ring_slot_at(void *base, uint32_t i, uint32_t request_bytes, uint32_t reply_bytes) {
  return (da_ring_slot *)((uint8_t *)base + DA_RING_HDR_BYTES + (size_t)i * da_ring_slot_stride(request_bytes, reply_bytes));
}

/* A spin that follows the other side's rhythm, both ends of a ring use it: spin_ns (0: never
 * spin), or half again last_ns (the last wait it would have caught) if that is longer, at
 * most max_ns (0: the fixed spin_ns). The client waits for a reply (plugin/doorbell.c), the
 * daemon for a ring's next request after its reply (server/doorbell.c); in a serving loop
 * both come at about the same interval one layer after another. */
static inline uint64_t da_ring_spin_follow(uint64_t spin_ns, uint64_t max_ns, uint64_t last_ns) {
  if (spin_ns == 0) return 0;
  uint64_t t = last_ns + last_ns / 2;
  if (t > max_ns) t = max_ns;
  return t > spin_ns ? t : spin_ns;
}

/*
 * A spinner yields its core on every empty turn, so whoever is runnable there goes first.
 * When a yield comes back late, another thread ran a time slice on that core: the machine has
 * no idle core, and a spin that follows a long gap only takes turns from the threads it waits
 * for (an H200 host's 16 cores, 16 clients each busy between calls: a following loop and
 * worker raised the clients' layer call p50 from ~105 to ~255 us and p99 to 25 ms; NOTES.md
 * v5.28). So a yield late by late_ns ends the spin, and for DA_SPIN_CALM_NS after it no spin
 * follows a gap: the fixed spin only. The daemon's loop and worker take late_ns from
 * --spin-late-us [1000: at 200 the guard tripped ~1,000 times a run with 16 busy clients and
 * the tails were no shorter; NOTES.md v5.28], a client's ring DA_SPIN_LATE_NS (200 us, as
 * measured). One guard per spinning thread (the client's ring is shared by its calling
 * threads: its fields are read and written atomically).
 */
#define DA_SPIN_LATE_NS 200000ull
#define DA_SPIN_CALM_NS 1000000000ull

typedef struct da_spin_guard {
  uint64_t late_ns;   /* a yield back this late gives way (0: never) */
  uint64_t calm_from; /* no following before this time */
  uint64_t late;      /* late yields, ever */
} da_spin_guard;

/* Whether a spin may follow a gap at time now. */
static inline int da_spin_guard_calm(const da_spin_guard *g, uint64_t now) {
  return now >= __atomic_load_n(&g->calm_from, __ATOMIC_RELAXED);
}

/* t0, t1: the clock before and after one yield of a spin. Returns 1 if the yield came back
 * late: the caller stops spinning. */
static inline int da_spin_guard_late(da_spin_guard *g, uint64_t t0, uint64_t t1) {
  if (g->late_ns == 0 || t1 - t0 < g->late_ns) return 0;
  __atomic_store_n(&g->calm_from, t1 + DA_SPIN_CALM_NS, __ATOMIC_RELAXED);
  __atomic_add_fetch(&g->late, 1, __ATOMIC_RELAXED);
  return 1;
}

#endif /* DA_DOORBELL_RING_H */
