#include "doorbell.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "doorbell_ring.h"
#include "log.h"

/* Ring ids live apart from arena ids (plane.h): a TensorRef naming a ring is NOT_FOUND. */
#define RING_ID_BASE 0x80000000u

enum { PENDING, READY, CLOSING };

struct da_ring {
  uv_poll_t poll; /* first: the close callback gets the ring from the handle */
  da_doorbell *db;
  uint32_t client, id;
  int state;
  int polling; /* poll initialised (READY and after): freed in its close callback */
  uint64_t token;
  int32_t pid;
  uint32_t uid;
  uint32_t slots, req_bytes, rep_bytes; /* as registered: never read back from the ring */
  uint64_t size;
  uint8_t *base; /* the mapping */
  da_ring_hdr *hdr;
  int efd;
  uint8_t *held; /* [slots]: 1 while a request taken from the slot is in the daemon */
  int holds;
  int active; /* on the active list: scanned every loop turn */
  uint64_t active_ns;
  uint64_t reply_ns; /* the last reply (0: none yet) */
  uint64_t gap_ns;   /* from a reply to the next request taken, the last time one followed a reply */
  da_ring *next, *anext;
};

struct da_doorbell {
  da_doorbell_cfg cfg;
  uv_idle_t idle;
  int handles; /* uv handles not yet closed */
  int closed;  /* da_doorbell_close was called: free once handles reach 0 */
  da_ring *rings, *active;
  uint32_t next_id;
  da_doorbell_counts counts;
  da_spin_guard guard; /* the loop's spin yields (doorbell_ring.h) */
};

static da_ring_slot *slot_at(const da_ring *r, uint32_t i) {
  return da_ring_slot_at(r->base, i, r->req_bytes, r->rep_bytes);
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static uint64_t random_u64(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v || v == 0) v = da_now_ns() ^ ((uint64_t)getpid() << 32);
  return v;
}

/* ---- lifetimes ---- */

static void maybe_free(da_doorbell *db) {
  if (db->closed && db->handles == 0) free(db);
}

static void on_idle_closed(uv_handle_t *h) {
  da_doorbell *db = (da_doorbell *)((char *)h - offsetof(da_doorbell, idle));
  db->handles--;
  maybe_free(db);
}

static void on_ring_closed(uv_handle_t *h) {
  da_ring *r = (da_ring *)h;
  da_doorbell *db = r->db;
  free(r);
  db->handles--;
  maybe_free(db);
}

static void deactivate(da_doorbell *db, da_ring *r) {
  if (!r->active) return;
  da_ring **pp = &db->active;
  while (*pp && *pp != r) pp = &(*pp)->anext;
  if (*pp) *pp = r->anext;
  r->anext = NULL;
  r->active = 0;
}

/* Unlinks r and releases everything it holds; the struct itself goes in the poll's close
 * callback when it has a poll. */
static void ring_free(da_doorbell *db, da_ring *r) {
  da_ring **pp = &db->rings;
  while (*pp != r) pp = &(*pp)->next;
  *pp = r->next;
  deactivate(db, r);
  if (r->polling) uv_poll_stop(&r->poll);
  if (r->base) {
    munmap(r->base, r->size);
    db->counts.rings--;
  }
  if (r->efd >= 0) close(r->efd);
  free(r->held);
  if (r->polling) uv_close((uv_handle_t *)&r->poll, on_ring_closed);
  else free(r);
}

static da_ring *find_client(da_doorbell *db, uint32_t client) {
  for (da_ring *r = db->rings; r; r = r->next)
    if (r->client == client) return r;
  return NULL;
}

/* ---- taking requests ---- */

static void on_idle(uv_idle_t *h);

/* The ring has activity: scan it every loop turn from now until spin_us after the last. */
static void activate(da_doorbell *db, da_ring *r, uint64_t now) {
  r->active_ns = now;
  if (r->active) return;
  __atomic_store_n(&r->hdr->sleeping, 0, __ATOMIC_SEQ_CST);
  r->active = 1;
  r->anext = db->active;
  db->active = r;
  if (!uv_is_active((uv_handle_t *)&db->idle)) uv_idle_start(&db->idle, on_idle);
}

/* Slot i was TAKEN: copy its request out (the client may rewrite the slot at any time),
 * check its length, decode it like an nng request and hand it to the daemon. */
static void take(da_doorbell *db, da_ring *r, uint32_t i) {
  da_ring_slot *s = slot_at(r, i);
  uint32_t len = __atomic_load_n(&s->req_len, __ATOMIC_RELAXED);
  uint64_t now = da_now_ns();
  da_wire_request w;
  if (r->holds == 0 && r->reply_ns != 0) r->gap_ns = now > r->reply_ns ? now - r->reply_ns : 0;
  r->held[i] = 1;
  r->holds++;
  db->counts.requests++;
  if (len == 0 || len > r->req_bytes) {
    memset(&w, 0, sizeof w);
    w.status = DETATTN_INVALID_ARGUMENT;
    snprintf(w.err, sizeof w.err, "doorbell slot %u: request length %u is not in [1, %u]", i, len, r->req_bytes);
  } else {
    void *buf = malloc(len);
    if (buf == NULL) {
      memset(&w, 0, sizeof w);
      w.status = DETATTN_RESOURCE_EXHAUSTED;
      snprintf(w.err, sizeof w.err, "out of memory taking a %u-byte request", len);
    } else {
      memcpy(buf, (uint8_t *)s + DA_RING_SLOT_HDR_BYTES, len);
      da_wire_limits lim = db->cfg.limits;
      size_t budget = 4 * (size_t)len + ((size_t)64 << 10);
      if (budget < lim.decode_bytes) lim.decode_bytes = budget;
      da_wire_decode(&lim, buf, len, &w);
      free(buf);
    }
  }
  db->cfg.request(db->cfg.arg, r->client, r, i, now, len, &w);
  da_wire_request_fini(&w);
}

/* Takes every request published in r and not held here; returns how many. Bounded: one
 * pass over the slots. */
static int scan(da_doorbell *db, da_ring *r) {
  int n = 0;
  for (uint32_t i = 0; i < r->slots && r->state == READY; i++) {
    if (r->held[i]) continue;
    uint32_t *st = &slot_at(r, i)->state;
    uint32_t want = DA_RING_REQUEST;
    if (__atomic_load_n(st, __ATOMIC_ACQUIRE) != want) continue;
    if (!__atomic_compare_exchange_n(st, &want, DA_RING_TAKEN, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    take(db, r, i);
    n++;
  }
  return n;
}

/* Every loop turn while rings are active: scan them; a ring quiet for spin_us sets its
 * sleeping word, is scanned once more (a client that published before it saw the word rang
 * no bell) and, still quiet, is left to its eventfd. */
static void on_idle(uv_idle_t *h) {
  da_doorbell *db = (da_doorbell *)((char *)h - offsetof(da_doorbell, idle));
  const uint64_t now = da_now_ns(), spin0 = (uint64_t)db->cfg.spin_us * 1000u;
  const uint64_t spin_max = da_spin_guard_calm(&db->guard, now) ? (uint64_t)db->cfg.spin_max_us * 1000u : 0;
  int took = 0;
  /* Detached while it is walked: a request taken may activate rings (they join db->active). */
  da_ring *list = db->active;
  db->active = NULL;
  while (list) {
    da_ring *r = list;
    list = r->anext;
    r->anext = NULL;
    if (r->state != READY) {
      r->active = 0;
      continue;
    }
    int n = scan(db, r);
    const uint64_t quiet = now > r->active_ns ? now - r->active_ns : 0;
    const uint64_t spin = da_ring_spin_follow(spin0, spin_max, r->gap_ns);
    if (n == 0 && quiet >= spin && r->state == READY) {
      __atomic_store_n(&r->hdr->sleeping, 1, __ATOMIC_SEQ_CST);
      n = scan(db, r);
      if (n > 0) __atomic_store_n(&r->hdr->sleeping, 0, __ATOMIC_SEQ_CST);
    }
    if (n > 0) r->active_ns = now;
    took += n;
    if (r->state == READY && (n > 0 || quiet < spin)) {
      r->anext = db->active;
      db->active = r;
    } else {
      r->active = 0;
    }
  }
  if (db->active == NULL) uv_idle_stop(&db->idle);
  if (took) db->cfg.scanned(db->cfg.arg);
  else if (db->active) {
    /* Spinning: the worker or a client runs first on a busy machine; late back, following
     * stops for a while and the rings past the fixed spin sleep at the next turn. */
    const uint64_t t1 = da_now_ns();
    sched_yield();
    da_spin_guard_late(&db->guard, t1, da_now_ns());
  }
}

/* The client rang: drain the eventfd (never blocking: RWF_NOWAIT, whatever the client did to
 * the descriptor's flags) and scan. */
static void on_ring_poll(uv_poll_t *h, int status, int events) {
  da_ring *r = (da_ring *)h;
  da_doorbell *db = r->db;
  if (status < 0 || r->state != READY) {
    if (status < 0) da_log_warn("doorbell ring of client %u: eventfd poll failed: %s", r->client, uv_strerror(status));
    uv_poll_stop(h);
    return;
  }
  (void)events;
  uint64_t v;
  struct iovec io = {.iov_base = &v, .iov_len = sizeof v};
  if (preadv2(r->efd, &io, 1, -1, RWF_NOWAIT) < 0 && errno != EAGAIN) {
    da_log_warn("doorbell ring of client %u: reading its eventfd: %s; it is no longer polled", r->client,
                strerror(errno));
    uv_poll_stop(h);
  }
  db->counts.wakeups++;
  activate(db, r, da_now_ns());
  if (scan(db, r) > 0) db->cfg.scanned(db->cfg.arg);
}

/* ---- the interface ---- */

int da_doorbell_open(da_doorbell **out, const da_doorbell_cfg *cfg, char *err, size_t errlen) {
  da_doorbell *db = calloc(1, sizeof(*db));
  if (db == NULL) {
    snprintf(err, errlen, "doorbell: out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  db->cfg = *cfg;
  db->guard.late_ns = cfg->spin_late_us > 0 ? (uint64_t)cfg->spin_late_us * 1000u : 0;
  db->next_id = 1;
  uv_idle_init(cfg->loop, &db->idle);
  db->handles = 1;
  *out = db;
  return 0;
}

void da_doorbell_close(da_doorbell *db) {
  if (db == NULL) return;
  while (db->rings) ring_free(db, db->rings);
  uv_close((uv_handle_t *)&db->idle, on_idle_closed);
  db->closed = 1;
  maybe_free(db);
}

int da_doorbell_register(da_doorbell *db, uint32_t client, const da_peer *peer, uint64_t size, uint32_t slots,
                         uint32_t request_bytes, uint32_t reply_bytes, uint32_t *id, uint64_t *token, char *err,
                         size_t errlen) {
  if (!peer->has_creds) {
    snprintf(err, errlen, "doorbell rings need an ipc connection (peer credentials)");
    return DETATTN_PERMISSION_DENIED;
  }
  if (!da_ring_geometry_ok(slots, request_bytes, reply_bytes)) {
    snprintf(err, errlen, "register_arena.doorbell: %u slots of %u + %u bytes; slots must be in [1, %u] and areas "
             "multiples of 64 in [%u, %u]", slots, request_bytes, reply_bytes, DA_RING_MAX_SLOTS, DA_RING_MIN_AREA,
             DA_RING_MAX_AREA);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (size != da_ring_bytes(slots, request_bytes, reply_bytes)) {
    snprintf(err, errlen, "register_arena.size %llu is not the layout size of a doorbell ring of %u slots of %u + %u "
             "bytes (%llu)", (unsigned long long)size, slots, request_bytes, reply_bytes,
             (unsigned long long)da_ring_bytes(slots, request_bytes, reply_bytes));
    return DETATTN_INVALID_ARGUMENT;
  }
  if (size > db->cfg.max_ring_bytes) {
    snprintf(err, errlen, "register_arena.doorbell: a ring of %llu bytes is over --max-arena-bytes %llu",
             (unsigned long long)size, (unsigned long long)db->cfg.max_ring_bytes);
    return DETATTN_INVALID_ARGUMENT;
  }
  da_ring *r = find_client(db, client);
  if (r && r->state != PENDING) {
    snprintf(err, errlen, "this connection has a doorbell ring already (ring %u)", r->id);
    return DETATTN_ALREADY_EXISTS;
  }
  if (r) ring_free(db, r); /* a pending one that was never handed over */
  r = calloc(1, sizeof(*r));
  if (r == NULL) {
    snprintf(err, errlen, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  r->db = db;
  r->client = client;
  r->id = RING_ID_BASE | db->next_id++;
  if (db->next_id >= RING_ID_BASE) db->next_id = 1;
  r->state = PENDING;
  r->token = random_u64();
  r->pid = peer->pid;
  r->uid = peer->uid;
  r->slots = slots;
  r->req_bytes = request_bytes;
  r->rep_bytes = reply_bytes;
  r->size = size;
  r->efd = -1;
  r->next = db->rings;
  db->rings = r;
  *id = r->id;
  *token = r->token;
  return 0;
}

/* 1 when fd is an eventfd. */
static int is_eventfd(int fd) {
  char path[64], link[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0) return 0;
  link[n] = '\0';
  return strcmp(link, "anon_inode:[eventfd]") == 0;
}

/* Checks the hand-over of pending ring r and maps it; on success r keeps fds[1]. */
static int check_and_map(da_doorbell *db, da_ring *r, const int *fds, int n_fds, char *why, size_t whylen) {
  if (n_fds != 2) {
    snprintf(why, whylen, "a doorbell hand-over carries two descriptors (the ring's memfd, an eventfd), got %d", n_fds);
    return DETATTN_INVALID_ARGUMENT;
  }
  int seals = fcntl(fds[0], F_GET_SEALS);
  int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if (seals < 0 || (seals & need) != need) {
    snprintf(why, whylen, "the ring is not a memfd sealed against shrinking and growing (F_SEAL_SHRINK | "
             "F_SEAL_GROW | F_SEAL_SEAL)");
    return DETATTN_INVALID_ARGUMENT;
  }
  struct stat st;
  if (fstat(fds[0], &st) != 0 || (uint64_t)st.st_size != r->size) {
    snprintf(why, whylen, "the ring's memfd has %lld bytes; its registered layout %llu", (long long)st.st_size,
             (unsigned long long)r->size);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (!is_eventfd(fds[1])) {
    snprintf(why, whylen, "the hand-over's second descriptor is not an eventfd");
    return DETATTN_INVALID_ARGUMENT;
  }
  uint64_t v;
  struct iovec io = {.iov_base = &v, .iov_len = sizeof v};
  if (preadv2(fds[1], &io, 1, -1, RWF_NOWAIT) < 0 && errno != EAGAIN) {
    snprintf(why, whylen, "the eventfd cannot be read without blocking (RWF_NOWAIT: %s)", strerror(errno));
    return DETATTN_FAILED_PRECONDITION;
  }
  void *base = mmap(NULL, r->size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  if (base == MAP_FAILED) {
    int e = errno;
    snprintf(why, whylen, "mapping the ring: %s%s", strerror(e), e == EPERM ? " (is it sealed against writing?)" : "");
    return e == EPERM ? DETATTN_INVALID_ARGUMENT : DETATTN_RESOURCE_EXHAUSTED;
  }
  da_ring_hdr h;
  memcpy(&h, base, sizeof h);
  if (h.magic != DA_RING_MAGIC || h.version != DA_RING_VERSION || h.slots != r->slots ||
      h.request_bytes != r->req_bytes || h.reply_bytes != r->rep_bytes) {
    munmap(base, r->size);
    snprintf(why, whylen, "the ring's header (magic %08x, version %u, %u slots of %u + %u bytes) does not match "
             "its registration (version %u, %u slots of %u + %u bytes)", h.magic, h.version, h.slots,
             h.request_bytes, h.reply_bytes, DA_RING_VERSION, r->slots, r->req_bytes, r->rep_bytes);
    return DETATTN_INVALID_ARGUMENT;
  }
  r->held = calloc(r->slots, 1);
  if (r->held == NULL || uv_poll_init(db->cfg.loop, &r->poll, fds[1]) != 0) {
    free(r->held);
    r->held = NULL;
    munmap(base, r->size);
    snprintf(why, whylen, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  r->polling = 1;
  db->handles++;
  r->base = base;
  r->hdr = base;
  r->efd = fds[1];
  db->counts.rings++;
  return 0;
}

int da_doorbell_handover(da_doorbell *db, uint32_t id, uint64_t token, int32_t pid, uint32_t uid, int *fds,
                         int n_fds, char *why, size_t whylen) {
  da_ring *r = db->rings;
  while (r && !(r->id == id && r->state == PENDING && r->token == token)) r = r->next;
  int rv;
  if (r == NULL) {
    snprintf(why, whylen, "no pending doorbell ring with that id and token");
    rv = DETATTN_NOT_FOUND;
  } else if (r->pid != pid || r->uid != uid) {
    snprintf(why, whylen, "the sender is not the process that registered the doorbell ring");
    rv = DETATTN_PERMISSION_DENIED;
  } else {
    rv = check_and_map(db, r, fds, n_fds, why, whylen);
  }
  for (int i = 0; i < n_fds; i++)
    if (rv != 0 || i != 1) close(fds[i]);
  if (rv != 0) {
    db->counts.refused++;
    return rv;
  }
  r->state = READY;
  /* Until a request arrives the daemon does not scan the ring: the client must ring. */
  __atomic_store_n(&r->hdr->sleeping, 1, __ATOMIC_SEQ_CST);
  uv_poll_start(&r->poll, UV_READABLE, on_ring_poll);
  da_log_debug("doorbell ring %u of client %u: %u slots of %u + %u bytes", r->id, r->client, r->slots, r->req_bytes,
               r->rep_bytes);
  return 0;
}

/* The reply area of a slot as da_wire_encode's allocator. */
typedef struct area {
  uint8_t *p;
  size_t cap, want;
} area;

static void *area_alloc(void *arg, size_t n) {
  area *a = arg;
  a->want = n;
  return n <= a->cap ? a->p : NULL;
}

int da_doorbell_reply(da_doorbell *db, da_ring *r, uint32_t slot, const da_wire_response *resp) {
  int rv = 0;
  int held = slot < r->slots && r->held && r->held[slot];
  if (r->state == READY && held) {
    da_ring_slot *s = slot_at(r, slot);
    area a = {.p = (uint8_t *)s + DA_RING_SLOT_HDR_BYTES + r->req_bytes, .cap = r->rep_bytes};
    void *buf;
    size_t len = 0;
    rv = da_wire_encode(resp, area_alloc, &a, &buf, &len);
    if (rv != 0) {
      char msg[128];
      if (a.want > a.cap)
        snprintf(msg, sizeof msg, "the reply (%zu bytes) does not fit the doorbell slot (%zu bytes)", a.want, a.cap);
      else
        snprintf(msg, sizeof msg, "out of memory encoding the reply");
      da_wire_response e = {.id = resp->id, .code = DETATTN_RESOURCE_EXHAUSTED, .message = msg};
      rv = da_wire_encode(&e, area_alloc, &a, &buf, &len);
    }
    if (rv == 0) {
      __atomic_store_n(&s->rep_len, (uint32_t)len, __ATOMIC_RELAXED);
      __atomic_store_n(&s->state, DA_RING_DONE, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&s->waiting, __ATOMIC_SEQ_CST)) futex_wake(&s->state);
    } else {
      da_log_warn("doorbell ring %u slot %u: cannot encode a reply; the call will time out", r->id, slot);
    }
    r->reply_ns = da_now_ns();
    activate(db, r, r->reply_ns);
  }
  if (held) {
    r->held[slot] = 0;
    r->holds--;
  }
  if (r->state == CLOSING && r->holds == 0) ring_free(db, r);
  return rv;
}

void da_doorbell_client_gone(da_doorbell *db, uint32_t client) {
  da_ring *r = find_client(db, client);
  if (r == NULL) return;
  if (r->state == PENDING || r->holds == 0) {
    ring_free(db, r);
    return;
  }
  r->state = CLOSING;
  deactivate(db, r);
  uv_poll_stop(&r->poll);
}

void da_doorbell_counts_get(const da_doorbell *db, da_doorbell_counts *out) {
  *out = db->counts;
  out->late = db->guard.late;
}
