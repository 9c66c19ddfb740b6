/*
 * doorbell.h — the same-host doorbell: requests of an ipc client taken from a shared-memory
 * ring (proto/doorbell_ring.h) instead of nng, answered in the same ring. nng keeps Hello,
 * registration, large copy-plane messages and remote clients; a ring carries the per-layer
 * calls of a same-host client at a fraction of nng's round trip.
 *
 * A ring belongs to one connection (at most one ring each). RegisterArena with a doorbell
 * geometry (da_doorbell_register) makes a pending ring with a random token; the same process
 * then hands the memfd and an eventfd over on the side socket (plane.h), which passes them to
 * da_doorbell_handover. The daemon checks the sender (pid and uid of the registering ipc
 * peer), the memfd's seals (no shrinking: no SIGBUS here), its size (exactly the layout's)
 * and its header (the registered geometry), that the second descriptor is an eventfd it can
 * read without blocking, then maps the ring and polls the eventfd.
 *
 * Taking requests: while requests arrive, every loop turn scans the active rings (a
 * uv_idle); spin_us after a ring's last request or reply (or, up to spin_max_us, half again
 * the last gap from a reply of the ring to its next request: a client that computes between
 * its calls finds the loop still scanning) it sets the ring's sleeping word, rescans once and
 * leaves it to its eventfd (a uv_poll). A taken request's bytes are copied
 * out of the ring, length-checked and decoded by da_wire_decode with the limits of nng
 * requests, then handed to the request callback with the ring and slot as its reply route;
 * the route is consumed by exactly one da_doorbell_reply. The daemon never blocks on a ring
 * and trusts nothing in it: a client can only break its own calls.
 *
 * Closing the connection (da_doorbell_client_gone) stops taking its requests; the ring is
 * unmapped and its eventfd closed once no request of it is in the daemon.
 *
 * Thread: the daemon's loop thread, for every function and callback.
 */
#ifndef DA_DOORBELL_H
#define DA_DOORBELL_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "transport.h"
#include "wire.h"

typedef struct da_doorbell da_doorbell;
typedef struct da_ring da_ring; /* one connection's ring */

typedef struct da_doorbell_cfg {
  uv_loop_t *loop;
  da_wire_limits limits;   /* as for nng requests (a request may use 4x its length + 64 KiB) */
  int spin_us;             /* scan every loop turn for this long after a ring's last activity */
  int spin_max_us;         /* or, after a reply, up to this long: 1.5x the ring's last gap from a reply
                            * to its next request (da_ring_spin_follow); 0: spin_us only */
  int spin_late_us;        /* a spin's yield back this late gives way (da_spin_guard); 0: never */
  uint64_t max_ring_bytes; /* largest ring (--max-arena-bytes) */
  /* A request taken from ring (of connection client) at slot: w is decoded (w->status says
   * whether validation passed); the callee may move it out (then zeroes it). The route
   * (ring, slot) must be answered exactly once with da_doorbell_reply. bytes: its length. */
  void (*request)(void *arg, uint32_t client, da_ring *ring, uint32_t slot, uint64_t recv_ns, size_t bytes,
                  da_wire_request *w);
  /* Called after a scan that took at least one request (the daemon forms batches then). */
  void (*scanned)(void *arg);
  void *arg;
} da_doorbell_cfg;

/* Counters since open, for metrics. */
typedef struct da_doorbell_counts {
  int rings;         /* mapped now */
  uint64_t requests; /* taken */
  uint64_t wakeups;  /* eventfd wake-ups of a sleeping ring */
  uint64_t refused;  /* hand-overs refused */
  uint64_t late;     /* the loop's spin yields that came back late (no idle core) */
} da_doorbell_counts;

int da_doorbell_open(da_doorbell **out, const da_doorbell_cfg *cfg, char *err, size_t errlen);
/* Unmaps every ring, closes its eventfd (uv handles close on the loop) and frees the
 * module once they have; routes still held are dropped unanswered. NULL is a no-op. */
void da_doorbell_close(da_doorbell *db);

/* A pending ring for connection client, registered by peer, of the given geometry and size.
 * Returns its id and the token the hand-over must carry. PERMISSION_DENIED for a peer
 * without credentials, INVALID_ARGUMENT for a geometry outside proto/doorbell_ring.h's
 * bounds, a size other than its layout's or a ring over max_ring_bytes, ALREADY_EXISTS when
 * the connection has a ring handed over already (a pending one is replaced). */
int da_doorbell_register(da_doorbell *db, uint32_t client, const da_peer *peer, uint64_t size, uint32_t slots,
                         uint32_t request_bytes, uint32_t reply_bytes, uint32_t *id, uint64_t *token, char *err,
                         size_t errlen);
/* The side socket's hand-over of ring id (the plane.h handover hook): fds[0] the memfd,
 * fds[1] the eventfd, from process pid of user uid. Takes the descriptors (closed unless
 * kept). Returns the status to answer; why says what was refused. */
int da_doorbell_handover(da_doorbell *db, uint32_t id, uint64_t token, int32_t pid, uint32_t uid, int *fds,
                         int n_fds, char *why, size_t whylen);
/* Answers the request taken from ring at slot with r: encoded into the slot's reply area (a
 * reply that does not fit is replaced by a short RESOURCE_EXHAUSTED status), DONE published,
 * the client woken when it sleeps. Nothing is written once the ring's connection closed.
 * Consumes the route. Returns 0, or RESOURCE_EXHAUSTED when not even the short status fit. */
int da_doorbell_reply(da_doorbell *db, da_ring *ring, uint32_t slot, const da_wire_response *r);
/* The connection closed: its ring (pending or not) goes, once no request of it is held. */
void da_doorbell_client_gone(da_doorbell *db, uint32_t client);
void da_doorbell_counts_get(const da_doorbell *db, da_doorbell_counts *out);

#endif /* DA_DOORBELL_H */
