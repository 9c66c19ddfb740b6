/*
 * transport.h — detattnd's nng side: a rep0 socket listening on one URL, a pool of
 * contexts (nng_ctx + nng_aio each), and pipe notifications. nng types stay in
 * transport.c.
 *
 * A context receives one request, decodes and validates it (wire.h) in the aio callback,
 * and hands it to the loop as an event; it is then held by the loop until
 * da_transport_reply sends the response on it, after which it receives again. So at most
 * n_contexts requests are in the daemon at once; more wait in nng.
 *
 * Message size: the socket's NNG_OPT_RECVMAXSZ is max_message_bytes + 64 KiB. Requests
 * above max_message_bytes and up to that hard cap are answered RESOURCE_EXHAUSTED; nng
 * closes the connection of a client that sends a larger one. Decoding a request may
 * allocate at most a budget proportional to its length (and never more than
 * limits.decode_bytes), so a small message cannot make the daemon allocate much.
 *
 * Connections: every connection is admitted at connect (nng's ADD_PRE, before anything is
 * read from it) against max_connections, max_conn_per_peer and, on ipc, the peer policy;
 * a refused one is closed and logged. Its CONNECT and DISCONNECT events are allocated at
 * admission, so a disconnect is never lost to an allocation failure. Every admitted
 * connection gets one DISCONNECT; one that goes before libnng reports it added gets no
 * CONNECT. Its requests may come before its CONNECT and after its DISCONNECT. A reply is
 * sent with a deadline (send_timeout_ms) and counted against its connection's queued reply
 * bytes (max_reply_bytes): a client that does not read its replies loses its connection,
 * and no context stays held by it.
 *
 * The ipc socket's directory must be owned by the daemon's user (or root) and not
 * writable by others unless sticky; a directory the daemon creates gets mode 0700; the lock
 * file is opened without following links and must be a regular file of the daemon's user.
 *
 * Thread: da_transport_poll, da_transport_reply and da_transport_close are called from the
 * loop thread. The notify callback runs on nng threads; it must only wake the loop.
 */
#ifndef DA_TRANSPORT_H
#define DA_TRANSPORT_H

#include <stdint.h>

#include "wire.h"

typedef struct da_transport da_transport;
typedef struct da_tctx da_tctx; /* a context held by the loop until it replies */

typedef enum da_event_kind {
  DA_EV_REQUEST = 0,    /* req is decoded (req.status says whether validation passed) */
  DA_EV_CONNECT = 1,    /* a client connection (pipe) was added */
  DA_EV_DISCONNECT = 2, /* a client connection was removed */
} da_event_kind;

/* Who is at the other end of a connection. */
typedef struct da_peer {
  int has_creds;      /* ipc: uid, gid and pid come from the socket (SO_PEERCRED) */
  uint32_t uid, gid;
  int32_t pid;
  uint64_t principal; /* the client a connection belongs to, for fairness and quotas: ipc:
                       * the peer process (pid); tcp: the peer address (without the port);
                       * otherwise the connection id */
  char name[64];      /* printable: "pid 123 uid 1000", "127.0.0.1:54321" or "pipe 7" */
} da_peer;

typedef struct da_event {
  da_event_kind kind;
  uint32_t client; /* nng pipe id */
  da_tctx *ctx;    /* DA_EV_REQUEST: where to send the reply */
  uint64_t recv_ns;
  size_t bytes;
  da_peer peer;        /* DA_EV_CONNECT */
  da_wire_request req; /* DA_EV_REQUEST; the receiver may move it out (then zero it) */
  struct da_event *next;
} da_event;

/* Who may connect over ipc: the daemon's own uid and root always; then a uid in uids, a
 * gid (the peer's primary gid) in gids, or, when uids is empty, the daemon's own gid.
 * tcp peers have no credentials and are not checked here. da_transport_open copies the
 * policy and its first DA_POLICY_IDS_MAX uids and gids. */
#define DA_POLICY_IDS_MAX 64
typedef struct da_peer_policy {
  uint32_t self_uid, self_gid;
  const uint32_t *uids;
  int n_uids;
  const uint32_t *gids;
  int n_gids;
} da_peer_policy;

typedef struct da_transport_cfg {
  const char *url;
  int n_contexts;
  da_wire_limits limits;
  void (*notify)(void *arg); /* called on an nng thread after an event is queued */
  void *arg;
  int max_connections;      /* more are refused at connect (logged); 0: no cap */
  int max_conn_per_peer;    /* per da_peer.principal; 0: no cap */
  int send_timeout_ms;      /* a reply not sent within this drops its connection; 0: none */
  size_t max_reply_bytes;   /* reply bytes queued on one connection; past it, dropped; 0: no cap */
  int ipc_mode;             /* permissions of the ipc socket; 0: nng's default */
  const da_peer_policy *policy; /* ipc peer check at connect, before any request is read; NULL: none */
  const char *tls_cert, *tls_key; /* tls+tcp: PEM files of the daemon's certificate and key */
  const char *tls_ca;             /* tls+tcp: CA file; set: client certificates are required */
} da_transport_cfg;

/* Connection counters since open (any thread reads them with da_transport_counts). */
typedef struct da_transport_counts {
  uint64_t accepted, refused_cap, refused_peer, refused_creds, dropped_slow, dropped_idle;
  uint64_t listener_replaced; /* ipc listeners replaced after libnng stopped accepting */
  int open;
} da_transport_counts;

/* Opens the socket, creates the ipc directory if needed (mode 0700), listens and starts
 * receiving. On failure writes a message to err. */
int da_transport_open(da_transport **out, const da_transport_cfg *cfg, char *err, size_t errlen);
/* The URL actually listened on (a tcp port 0 replaced by the port bound). */
const char *da_transport_url(const da_transport *t);
/* Reads who is at the other end of connection `client` (an nng pipe id) into out. Returns
 * DETATTN_NOT_FOUND when the connection is gone. Any thread. */
int da_transport_peer(da_transport *t, uint32_t client, da_peer *out);
/* Pops the oldest event, or NULL. Free it with da_transport_event_free. */
da_event *da_transport_poll(da_transport *t);
void da_transport_event_free(da_event *ev);
/* Encodes r and sends it on ctx; ctx goes back to receiving. Always consumes ctx. Returns
 * non-zero if the reply could not be encoded or sent (it is then lost; the client times
 * out). */
int da_transport_reply(da_transport *t, da_tctx *ctx, const da_wire_response *r);
/* Closes connection `client` (its DISCONNECT event follows); why goes to the log. */
void da_transport_drop(da_transport *t, uint32_t client, const char *why);
/* The socket descriptor of nng pipe `pipe`, or -1 (nng_fd.c says why and how). */
int da_nng_pipe_fd(uint32_t pipe);
void da_transport_counts_get(da_transport *t, da_transport_counts *out);
/* Refuses new connections from now on; the connections open stay. Idempotent. */
void da_transport_stop_listening(da_transport *t);
/* Stops receiving, waits up to wait_ms for replies being sent, closes the socket and frees
 * everything, queued events included. NULL is a no-op. May block inside nng_close: the
 * daemon bounds it with its shutdown watchdog. */
/* Called every second from the loop (ipc only): checks that the listener still takes new
 * connections and replaces it when it does not (libnng 1.5.2; see transport.c). */
void da_transport_check_listener(da_transport *t);

void da_transport_close(da_transport *t, int wait_ms);
/* The ipc lock file's descriptor, or -1 (for a shutdown that must exit without nng). */
int da_transport_lock_fd(const da_transport *t);

#endif /* DA_TRANSPORT_H */
