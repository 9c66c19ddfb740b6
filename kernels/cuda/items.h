/*
 * items.h — how the CUDA backend cuts a batch's attentions into work items: blocks of rows
 * and, for blocks run as partials, runs of consecutive splits. Plain C with no CUDA, so it
 * is tested without a device (tests/cuda/test_items.c). The bits of a row do not depend on
 * any choice made here (DESIGN.md 1, step 5); only the time does.
 */
#ifndef DA_CUDA_ITEMS_H
#define DA_CUDA_ITEMS_H

#include <stdint.h>

#include "backend.h"

/* The splits [j0, j1) of size S that rows [row0, row0 + brows) of attention a see (a row is
 * a (query token, q head of one kv head's group) pair; the rows of one token are adjacent). */
void da_cu_block_splits(const da_model *m, int brows, int S, const da_attn *a, int64_t row0, int *j0, int *j1);

/*
 * Splits per work item for the blocks of b run as partials (partial[i] non-zero for
 * attention i): each block of n splits becomes ceil(n / per) items per kv head. slots is how
 * many items run at once (the persistent grid's CTAs, or the resident CTAs of all SMs); the
 * choice is the per whose items fill the fewest waves of slots, costed in key tiles of T
 * tokens with one tile more per item for its start (so ties go to fewer, longer items).
 * Returns per (1 .. 64) and the item count in *n_items (0 when nothing runs as partials).
 */
int da_cu_partial_per(const da_model *m, int brows, int S, int T, const da_batch *b, const unsigned char *partial,
                      int64_t slots, int64_t *n_items);

#endif /* DA_CUDA_ITEMS_H */
