/*
 * doorbell.c — libdetattn's side of the same-host doorbell (client_impl.h, layout and
 * protocol in proto/doorbell_ring.h): a ring of slots in a sealed memfd, each carrying one
 * call at a time, and the eventfd that wakes a sleeping daemon.
 *
 * Any number of threads call at once: a thread owns the slot it claimed (CAS FREE ->
 * CLAIMED) until its call has its reply. A call that gives up after the daemon took its
 * request (its deadline passed, or it was never waited for) marks the slot abandoned; the
 * slot is reclaimed by whichever call next finds it DONE. A reply is copied out of the slot
 * before it is decoded: the daemon's bytes are checked like an nng reply's (client.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "client_impl.h"
#include "da.h"
#include "doorbell_ring.h"

struct da_ring {
  int refs; /* atomic */
  int memfd, efd;
  uint8_t *base;
  uint64_t size;
  uint32_t slots, req_bytes, rep_bytes;
  uint64_t spin_ns;
  int adaptive;     /* the spin follows the last call's wait (da_ring_spin_budget) */
  da_spin_guard guard; /* unless a spin's yield came back late lately (doorbell_ring.h) */
  uint64_t last_ns; /* atomic: how long the ring's last answered call waited */
  int waiters;      /* atomic: calls in da_ring_wait */
  int dead;        /* atomic: da_ring_lost was called */
  int dead_status; /* written before dead */
  uint8_t *abandoned; /* [slots], atomic: the slot's call gave up after the daemon took it */
  unsigned next;      /* atomic: where the next claim starts looking */
};

static da_ring_slot *slot_at(const da_ring *r, uint32_t i) {
  return da_ring_slot_at(r->base, i, r->req_bytes, r->rep_bytes);
}
static da_ring_hdr *hdr(const da_ring *r) { return (da_ring_hdr *)r->base; }

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* Sleeps while *word == val, at most timeout_ns (0: no limit); returns on a wake-up, a
 * changed word, a signal or the timeout. Shared (not FUTEX_PRIVATE): the daemon wakes it. */
static void futex_wait(uint32_t *word, uint32_t val, uint64_t timeout_ns) {
  struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000u), .tv_nsec = (long)(timeout_ns % 1000000000u)};
  syscall(SYS_futex, word, FUTEX_WAIT, val, timeout_ns ? &ts : NULL, NULL, 0);
}

int da_ring_create(da_ring **out, uint32_t slots, uint32_t request_bytes, uint32_t reply_bytes, int spin_us) {
  *out = NULL;
  if (!da_ring_geometry_ok(slots, request_bytes, reply_bytes))
    return da_err(DETATTN_INTERNAL, "doorbell ring geometry %u x (%u + %u) out of bounds", slots, request_bytes,
                  reply_bytes);
  da_ring *r = calloc(1, sizeof *r);
  if (!r) return da_err(DETATTN_RESOURCE_EXHAUSTED, "out of memory for a doorbell ring");
  r->refs = 1;
  r->memfd = r->efd = -1;
  r->slots = slots;
  r->req_bytes = request_bytes;
  r->rep_bytes = reply_bytes;
  r->size = da_ring_bytes(slots, request_bytes, reply_bytes);
  r->spin_ns = spin_us > 0 ? (uint64_t)spin_us * 1000u : 0;
  r->guard.late_ns = DA_SPIN_LATE_NS;
  r->adaptive = sysconf(_SC_NPROCESSORS_ONLN) >= DA_RING_ADAPTIVE_CPUS;
  int st;
  if (!(r->abandoned = calloc(slots, 1))) {
    st = da_err(DETATTN_RESOURCE_EXHAUSTED, "out of memory for a doorbell ring");
    goto fail;
  }
  if ((r->memfd = memfd_create("detattn-doorbell", MFD_CLOEXEC | MFD_ALLOW_SEALING)) < 0) {
    st = da_err(DETATTN_UNAVAILABLE, "doorbell ring: memfd_create: %s", strerror(errno));
    goto fail;
  }
  if (ftruncate(r->memfd, (off_t)r->size) != 0 ||
      fcntl(r->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    st = da_err(DETATTN_UNAVAILABLE, "doorbell ring memfd of %llu bytes: %s", (unsigned long long)r->size,
                strerror(errno));
    goto fail;
  }
  void *base = mmap(NULL, r->size, PROT_READ | PROT_WRITE, MAP_SHARED, r->memfd, 0);
  if (base == MAP_FAILED) {
    st = da_err(DETATTN_RESOURCE_EXHAUSTED, "mmap of a %llu-byte doorbell ring: %s", (unsigned long long)r->size,
                strerror(errno));
    goto fail;
  }
  r->base = base;
  if ((r->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
    st = da_err(DETATTN_UNAVAILABLE, "doorbell ring: eventfd: %s", strerror(errno));
    goto fail;
  }
  da_ring_hdr *h = hdr(r);
  h->magic = DA_RING_MAGIC;
  h->version = DA_RING_VERSION;
  h->slots = slots;
  h->request_bytes = request_bytes;
  h->reply_bytes = reply_bytes;
  /* Until the daemon scans the ring, every request rings the bell. */
  __atomic_store_n(&h->sleeping, 1, __ATOMIC_SEQ_CST);
  *out = r;
  return DETATTN_OK;
fail:
  da_ring_unref(r);
  return st;
}

void da_ring_geometry(const da_ring *r, uint32_t *slots, uint32_t *request_bytes, uint32_t *reply_bytes,
                      uint64_t *size) {
  *slots = r->slots;
  *request_bytes = r->req_bytes;
  *reply_bytes = r->rep_bytes;
  *size = r->size;
}

int da_ring_handover(const da_ring *r, const char *path, uint32_t id, uint64_t token, int timeout_ms) {
  int fds[2] = {r->memfd, r->efd};
  return da_side_handover(path, DA_RING_MAGIC, id, token, fds, 2, timeout_ms, "the doorbell ring");
}

void da_ring_ref(da_ring *r) { __atomic_add_fetch(&r->refs, 1, __ATOMIC_RELAXED); }

void da_ring_unref(da_ring *r) {
  if (!r || __atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (r->base) munmap(r->base, r->size);
  if (r->memfd >= 0) close(r->memfd);
  if (r->efd >= 0) close(r->efd);
  free(r->abandoned);
  free(r);
}

void da_ring_lost(da_ring *r, int status) {
  r->dead_status = status;
  __atomic_store_n(&r->dead, 1, __ATOMIC_SEQ_CST);
  for (uint32_t i = 0; i < r->slots; i++) {
    uint32_t *st = &slot_at(r, i)->state;
    for (uint32_t want = __atomic_load_n(st, __ATOMIC_SEQ_CST); want == DA_RING_REQUEST || want == DA_RING_TAKEN;) {
      if (__atomic_compare_exchange_n(st, &want, DA_RING_LOST, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        futex_wake(st);
        break;
      }
    }
  }
}

int da_ring_start(da_ring *r, const void *req, size_t len, size_t reply_max, uint32_t *slot) {
  if (len == 0 || len > r->req_bytes || reply_max > r->rep_bytes || __atomic_load_n(&r->dead, __ATOMIC_ACQUIRE))
    return DETATTN_RESOURCE_EXHAUSTED;
  uint32_t n = r->slots, first = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED) % n, i = 0;
  da_ring_slot *s = NULL;
  for (uint32_t k = 0; k < n && !s; k++) {
    i = (first + k) % n;
    uint32_t *st = &slot_at(r, i)->state, want = __atomic_load_n(st, __ATOMIC_ACQUIRE);
    if (want == DA_RING_DONE && !__atomic_load_n(&r->abandoned[i], __ATOMIC_ACQUIRE)) continue;
    if (want != DA_RING_FREE && want != DA_RING_DONE) continue;
    if (!__atomic_compare_exchange_n(st, &want, DA_RING_CLAIMED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    __atomic_store_n(&r->abandoned[i], 0, __ATOMIC_RELAXED);
    s = slot_at(r, i);
  }
  if (!s) return DETATTN_RESOURCE_EXHAUSTED;
  memcpy((uint8_t *)s + DA_RING_SLOT_HDR_BYTES, req, len);
  __atomic_store_n(&s->req_len, (uint32_t)len, __ATOMIC_RELAXED);
  __atomic_store_n(&s->rep_len, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->waiting, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->state, DA_RING_REQUEST, __ATOMIC_SEQ_CST);
  /* Dekker with da_ring_lost: it set dead before sweeping, we published before reading dead,
   * so a request published after the sweep passed is seen here and withdrawn. */
  if (__atomic_load_n(&r->dead, __ATOMIC_SEQ_CST)) {
    uint32_t want = DA_RING_REQUEST;
    __atomic_compare_exchange_n(&s->state, &want, DA_RING_LOST, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  } else if (__atomic_load_n(&hdr(r)->sleeping, __ATOMIC_SEQ_CST)) {
    /* Dekker with the daemon: it sets sleeping, then scans once more before it sleeps. */
    uint64_t one = 1;
    ssize_t w = write(r->efd, &one, sizeof one);
    (void)w; /* EAGAIN: the counter is full, the daemon will wake anyway */
  }
  *slot = i;
  return DETATTN_OK;
}

/* The slot's reply (state DONE): copied out, checked for length; the slot is freed. */
static int take_reply(da_ring *r, da_ring_slot *s, nng_msg **reply, char *msg, size_t msglen) {
  uint32_t len = __atomic_load_n(&s->rep_len, __ATOMIC_RELAXED);
  int st = DETATTN_OK;
  nng_msg *m = NULL;
  if (len == 0 || len > r->rep_bytes) {
    snprintf(msg, msglen, "doorbell reply of %u bytes from the daemon; a slot holds at most %u", len, r->rep_bytes);
    st = DETATTN_INTERNAL;
  } else if (nng_msg_alloc(&m, len) != 0) {
    snprintf(msg, msglen, "out of memory for a %u-byte reply", len);
    st = DETATTN_RESOURCE_EXHAUSTED;
  } else {
    memcpy(nng_msg_body(m), (uint8_t *)s + DA_RING_SLOT_HDR_BYTES + r->req_bytes, len);
  }
  __atomic_store_n(&s->state, DA_RING_FREE, __ATOMIC_RELEASE);
  *reply = m;
  return st;
}

uint64_t da_ring_spin_budget(uint64_t spin_ns, int adaptive, int others, uint64_t last_ns) {
  return da_ring_spin_follow(spin_ns, adaptive && others == 0 ? DA_RING_SPIN_MAX_NS : 0, last_ns);
}

static int wait_slot(da_ring *r, da_ring_slot *s, uint32_t slot, uint64_t deadline_ns, uint64_t until,
                     uint64_t *done_ns, nng_msg **reply, char *msg, size_t msglen) {
  for (;;) {
    uint32_t st = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
    if (st == DA_RING_DONE) {
      *done_ns = da_now_ns();
      return take_reply(r, s, reply, msg, msglen);
    }
    if (st == DA_RING_LOST) {
      __atomic_store_n(&s->state, DA_RING_FREE, __ATOMIC_RELEASE);
      int why = __atomic_load_n(&r->dead, __ATOMIC_ACQUIRE) ? r->dead_status : DETATTN_UNAVAILABLE;
      snprintf(msg, msglen, why == DETATTN_CANCELLED ? "call cancelled: the client was closed"
                                                     : "connection to the daemon lost with the request in flight");
      return why;
    }
    if (st != DA_RING_REQUEST && st != DA_RING_TAKEN) {
      __atomic_store_n(&r->abandoned[slot], 1, __ATOMIC_RELEASE);
      snprintf(msg, msglen, "doorbell slot %u in state %u (the ring was overwritten)", slot, st);
      return DETATTN_INTERNAL;
    }
    uint64_t now = da_now_ns();
    if (deadline_ns && now >= deadline_ns) {
      uint32_t want = DA_RING_REQUEST;
      if (__atomic_compare_exchange_n(&s->state, &want, DA_RING_FREE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        snprintf(msg, msglen, "no reply from the daemon before the deadline (the request was withdrawn unread)");
        return DETATTN_DEADLINE_EXCEEDED;
      }
      if (want == DA_RING_DONE || want == DA_RING_LOST) continue; /* answered just now */
      __atomic_store_n(&r->abandoned[slot], 1, __ATOMIC_RELEASE);
      snprintf(msg, msglen, "no reply from the daemon before the deadline");
      return DETATTN_DEADLINE_EXCEEDED;
    }
    if (now < until) {
      sched_yield(); /* on a busy machine the daemon's threads run first */
      if (da_spin_guard_late(&r->guard, now, da_now_ns())) until = 0;
      continue;
    }
    /* Dekker with the daemon's reply: it publishes DONE, then reads waiting. */
    __atomic_store_n(&s->waiting, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->state, __ATOMIC_SEQ_CST) == st) futex_wait(&s->state, st, deadline_ns ? deadline_ns - now : 0);
    __atomic_store_n(&s->waiting, 0, __ATOMIC_RELAXED);
  }
}

int da_ring_wait(da_ring *r, uint32_t slot, uint64_t deadline_ns, nng_msg **reply, char *msg, size_t msglen) {
  *reply = NULL;
  const uint64_t t0 = da_now_ns();
  const int others = __atomic_fetch_add(&r->waiters, 1, __ATOMIC_ACQ_REL);
  const uint64_t spin =
      da_ring_spin_budget(r->spin_ns, r->adaptive && da_spin_guard_calm(&r->guard, t0), others,
                          __atomic_load_n(&r->last_ns, __ATOMIC_RELAXED));
  uint64_t done_ns = 0;
  int st = wait_slot(r, slot_at(r, slot), slot, deadline_ns, spin ? t0 + spin : 0, &done_ns, reply, msg, msglen);
  __atomic_fetch_sub(&r->waiters, 1, __ATOMIC_ACQ_REL);
  if (done_ns) __atomic_store_n(&r->last_ns, done_ns - t0, __ATOMIC_RELAXED);
  return st;
}

void da_ring_abandon(da_ring *r, uint32_t slot) {
  da_ring_slot *s = slot_at(r, slot);
  uint32_t want = DA_RING_REQUEST;
  if (__atomic_compare_exchange_n(&s->state, &want, DA_RING_FREE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  if (want == DA_RING_DONE || want == DA_RING_LOST) {
    __atomic_store_n(&s->state, DA_RING_FREE, __ATOMIC_RELEASE);
    return;
  }
  __atomic_store_n(&r->abandoned[slot], 1, __ATOMIC_RELEASE);
}
