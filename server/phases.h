/*
 * phases.h — --phase-timing (diagnostics): where a decode Forward's time goes inside the
 * daemon, phase by phase, from its receipt to its reply. The loop thread records each
 * decode Forward (every sequence at most decode_tokens new tokens) as it is answered, and
 * logs the phases' p50 / p90 once, at exit:
 *   admit    receipt to admission (decode, tensor references, the cuda plane's ready event)
 *   batch    admission to its batch going to the worker (the batch before it still running)
 *   worker   to the worker's da_backend_submit (the worker's wake-up)
 *   backend  submit to the end of finish (host staging, the device, the worker's poll)
 *   loop     to the loop taking the batch back (its wake-up)
 *   reply    to the reply handed to the transport (completion, encoding)
 * The transport itself (nng or the doorbell, and the client's wake-up) is outside: the
 * client's layer call less `total` is that.
 */
#ifndef DA_PHASES_H
#define DA_PHASES_H

#include <stdint.h>

enum { DA_PH_ADMIT, DA_PH_BATCH, DA_PH_WORKER, DA_PH_BACKEND, DA_PH_LOOP, DA_PH_REPLY, DA_PH_TOTAL, DA_PH_N };

typedef struct da_phases da_phases;

/* NULL when out of memory. */
da_phases *da_phases_new(void);
void da_phases_free(da_phases *p);
/* One Forward's times (da_now_ns), in order: receipt, admission, handed to the worker, the
 * batch's submit, its finish's end, taken back by the loop, reply. Times out of order (a
 * Forward answered by an error, or one whose items ran in several batches) are skipped. */
void da_phases_add(da_phases *p, const uint64_t t[DA_PH_N]);
/* Logs one line: the count and each phase's p50 / p90 in us (nothing if none was added). */
void da_phases_log(const da_phases *p);

#endif /* DA_PHASES_H */
