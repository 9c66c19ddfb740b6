/*
 * plane.h — data planes: how a Forward's tensors reach the daemon and its outputs go back.
 *
 *  copy  tensors are bytes in the request and the reply (every transport; the reference);
 *  shm   tensors are references into arenas: shared memory the client created (a sealed
 *        memfd) and handed over on the ipc side socket <ipc path>.arena; the backend reads
 *        q/k/v and writes o/lse in place. With a device backend the arena is pinned
 *        (cudaHostRegister) and kernels read and write it over PCIe: no host copy at all.
 *  cuda  tensors are references into device buffers of the client (CUDA IPC memory
 *        handles, opened once per registration); events the client shares (IPC event
 *        handles) say when inputs are ready and are recorded when outputs are written.
 *
 * Arenas, CUDA buffers and events share one id space per connection ("regions").
 * da_planes_tensor resolves a da_wire_tensor (wire.h) of any kind to a host and/or device
 * address and holds what it names until da_planes_release, so op handlers never know which
 * plane carried a tensor. A new plane is one file behind these calls.
 *
 * Arenas. RegisterArena (on ipc, from a peer with credentials) creates a pending arena with
 * a random token; the same process then connects to the side socket and sends
 * {"DAAR", arena id, token} with the memfd (SCM_RIGHTS). The daemon checks the sender's pid
 * and uid against the registering peer, that the memfd is sealed against shrinking (so the
 * client cannot make the daemon fault by truncating it) and large enough, maps it, and
 * answers one status byte. A client can only name arenas registered on its own connection.
 * An arena is unmapped when it is unregistered or its connection closes, once no request
 * in flight holds it. Side connections and pending arenas expire (2 s, 10 s).
 *
 * Thread: the daemon's loop thread; the side socket is a uv_poll on that loop.
 */
#ifndef DA_PLANE_H
#define DA_PLANE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "transport.h"
#include "wire.h"

typedef struct da_planes da_planes;

typedef struct da_planes_cfg {
  uv_loop_t *loop;
  const char *ipc_path;     /* the daemon's ipc socket path; NULL or "": no shm plane */
  int ipc_mode;             /* permissions of the side socket (as the ipc socket's) */
  uint64_t max_arena_bytes; /* largest arena */
  int max_arenas;           /* per connection */
  /* Optional: a device backend; arenas are then mapped for its kernels, and with an ipc
   * path the cuda plane is offered. */
  da_backend *be;
  /* Optional: hand-overs on the side socket of another kind than arenas (a first word other
   * than "DAAR"; doorbell.h): called with the message's magic, id and token, the sender's
   * pid and uid (SO_PEERCRED) and the descriptors it carried (up to DA_PLANES_SIDE_FDS),
   * which the callee owns from the call on. Returns the status byte to answer; on refusal
   * it writes why (logged). Without it such hand-overs are refused. */
  int (*handover)(void *arg, uint32_t magic, uint32_t id, uint64_t token, int32_t pid, uint32_t uid, int *fds,
                  int n_fds, char *why, size_t whylen);
  void *handover_arg;
} da_planes_cfg;

/* Most descriptors one side socket message may carry (more are closed). */
#define DA_PLANES_SIDE_FDS 4

/* Opens the planes: the side socket when ipc_path is set. On failure writes err. */
int da_planes_open(da_planes **out, const da_planes_cfg *cfg, char *err, size_t errlen);
/* Unmaps every arena and closes the side socket (its uv handles close on the loop). NULL is a
 * no-op. */
void da_planes_close(da_planes *p);
/* The planes offered, NULL-terminated ("copy"; "shm" with a side socket; "cuda" with a
 * device backend too). */
const char *const *da_planes_names(const da_planes *p);
/* The side socket's path, or "". */
const char *da_planes_arena_path(const da_planes *p);

/* A pending arena of size bytes for connection client, registered by peer. Returns its id and
 * the token the side socket expects. FAILED_PRECONDITION without a shm plane,
 * PERMISSION_DENIED for a peer without credentials, INVALID_ARGUMENT for a size of 0 or over
 * max_arena_bytes, RESOURCE_EXHAUSTED past max_arenas. */
int da_planes_register(da_planes *p, uint32_t client, const da_peer *peer, uint64_t size, uint32_t *arena,
                       uint64_t *token, char *err, size_t errlen);
/* Releases arena (now, or once no request holds it). NOT_FOUND if client has no such arena. */
int da_planes_unregister(da_planes *p, uint32_t client, uint32_t arena, char *err, size_t errlen);
/* CUDA plane: registers a device buffer (a cudaIpcMemHandle_t of an allocation holding at
 * least size bytes; event 0) or an event (a cudaIpcEventHandle_t; event 1) of connection
 * client's process, opened at once. FAILED_PRECONDITION without a cuda plane,
 * PERMISSION_DENIED without peer credentials, INVALID_ARGUMENT for a handle the driver
 * refuses, RESOURCE_EXHAUSTED past max_arenas regions. */
int da_planes_register_cuda(da_planes *p, uint32_t client, const da_peer *peer, int event, const void *handle,
                            size_t handle_len, uint64_t size, uint32_t *id, char *err, size_t errlen);

/* A resolved tensor: host is its host address (NULL for device-only memory, or for a copy
 * output returned in the reply), dev its device address (NULL unless a device backend can
 * reach it from a kernel). */
typedef struct da_plane_ptr {
  void *host, *dev;
} da_plane_ptr;
/* Resolves t for connection client to t->len bytes: its data (copy), or the region's memory
 * at t->offset, which must be inside it and aligned to align. A reference holds its region:
 * call da_planes_release(client, t->arena) once for each success with t->arena != 0.
 * Errors: NOT_FOUND (no such region on this connection, or an event), FAILED_PRECONDITION
 * (not handed over yet, or being released), INVALID_ARGUMENT (out of bounds, misaligned). */
int da_planes_tensor(da_planes *p, uint32_t client, const da_wire_tensor *t, size_t align, da_plane_ptr *out,
                     char *err, size_t errlen);
/* Which plane region id of client is on, as DA_METRICS_PLANE_*: 0 copy (id 0, or no such
 * region), 1 shm (an arena), 2 cuda (a CUDA buffer). */
int da_planes_plane(const da_planes *p, uint32_t client, uint32_t id);
/* Resolves event id of client to the backend's event and holds it (release as above).
 * NOT_FOUND when client has no such event. */
int da_planes_event(da_planes *p, uint32_t client, uint32_t id, void **ev, char *err, size_t errlen);
void da_planes_release(da_planes *p, uint32_t client, uint32_t arena);
/* The connection closed: its arenas go (each once no request holds it). */
void da_planes_client_gone(da_planes *p, uint32_t client);
/* Arenas mapped now, and bytes mapped (for stats and tests): every connection's when client
 * is 0, else client's. */
void da_planes_usage(const da_planes *p, uint32_t client, int *arenas, uint64_t *bytes);

#endif /* DA_PLANE_H */
