/*
 * daemon.h — detattnd's loop: one libuv loop thread owns all daemon state (clients,
 * sequences, the KV cache bookkeeping, the scheduler, stats) and dispatches each request
 * through a table of op handlers. The transport (nng) hands it decoded requests; the worker
 * runs batches on the backend and hands them back. Replies are encoded and sent from here.
 *
 * Ordering: sequences belong to the client connection (nng pipe) that opened them; other
 * clients get NOT_FOUND. A client's requests that name sequences (fork, truncate, close,
 * forward) are applied in arrival order: a Forward is admitted at once (its pages are
 * reserved and its layer length advanced), while fork, truncate and close wait until the
 * sequence has no queued or running work; while one waits, every later request of that
 * client that names a sequence waits behind it. hello, stats and seq_open never wait.
 *
 * Wire sequence ids are (generation << 32) | KV cache handle, so a closed id is not
 * reused until its handle has been opened 2^32 times.
 *
 * When a connection drops, its waiting requests are dropped, its queued forwards that have
 * not started are cancelled, and its sequences are closed as soon as their running work
 * finishes (pages go back to the pool).
 *
 * SIGTERM/SIGINT: the listener closes (no new connections), new requests get UNAVAILABLE
 * "draining"; everything accepted is finished and answered, then the daemon exits 0. The
 * whole shutdown is bounded: past drain-timeout-ms (+ 2 s to close the socket) the daemon
 * removes its ipc socket, releases its lock and exits 4 whatever is still running or
 * stuck (a watchdog thread; nng_close has been seen to hang). Under systemd it reports
 * READY=1, STOPPING=1 and WATCHDOG=1 (Type=notify, WatchdogSec). A backend run that reports a sticky device error
 * (UNAVAILABLE) fails the requests of that batch and of every later one (UNAVAILABLE, with
 * the backend's message), new requests get UNAVAILABLE, and the daemon exits 3. The test
 * setting --fail-after-batches N makes batch N and later fail this way without a device.
 *
 * Batches: the worker holds up to two (worker.h). When it is idle, a batch is formed as
 * soon as the wait window allows; while one runs, the next is formed from whatever work is
 * waiting and handed over at once, so its staging overlaps the running one's kernels.
 */
#ifndef DA_DAEMON_H
#define DA_DAEMON_H

#include "config.h"

#define DA_EXIT_OK 0
#define DA_EXIT_START 1  /* could not start: backend, KV cache or listener */
#define DA_EXIT_CONFIG 2 /* bad settings */
#define DA_EXIT_DEVICE 3 /* the backend's device failed for good */
#define DA_EXIT_TIMEOUT 4 /* SIGTERM: the drain or the close did not finish before its deadline */

/* Runs a daemon with cfg until it is told to stop; returns a DA_EXIT_* code. Prints
 * "listening on <url>" to stderr when it accepts requests. */
int da_daemon_main(const da_config *cfg);

#endif /* DA_DAEMON_H */
