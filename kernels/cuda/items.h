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
#include "item.h"

/* The splits [j0, j1) of size S that rows [row0, row0 + brows) of attention a see (a row is
 * a (query token, q head of one kv head's group) pair; the rows of one token are adjacent). */
void da_cu_block_splits(const da_model *m, int brows, int S, const da_attn *a, int64_t row0, int *j0, int *j1);

/*
 * Splits per work item for the blocks of b run as partials in items of per splits
 * (partial[i] == 1 for attention i; other non-zero kinds are the caller's): each block of n splits becomes ceil(n / per) items per kv head. slots is how
 * many items run at once (the persistent grid's CTAs, or the resident CTAs of all SMs); the
 * choice is the per whose items fill the fewest waves of slots, costed in key tiles of T
 * tokens with one tile more per item for its start (so ties go to fewer, longer items).
 * Returns per (1 .. 64) and the item count in *n_items (0 when nothing runs as partials).
 */
/* The items of the partial blocks of b at per splits an item (ceil(n / per) per block and kv
 * head). */
int64_t da_cu_partial_items(const da_model *m, int brows, int S, const da_batch *b, const unsigned char *partial,
                            int per);

int da_cu_partial_per(const da_model *m, int brows, int S, int T, const da_batch *b, const unsigned char *partial,
                      int64_t slots, int64_t *n_items);

/* The key tiles of T tokens that the CTA running item it walks: from the first row's window
 * start to the last row's position, within the item's splits [j0, j1) (prefill_sm90.cu's
 * cta_range). 0 for an item that sees no key. */
int64_t da_cu_item_tiles(const da_model *m, int brows, int S, int T, const da_attn *a, const da_cu_item *it);

/*
 * Deals items[0, n) to a persistent grid of `grid` CTAs where CTA c runs the items at
 * positions c, c + grid, c + 2 grid, ... (so ceil((n - c) / grid) of them): in list order,
 * each item to the CTA with the least work so far that still has a position free, costed
 * in key tiles plus one per item for its start, and the list is rewritten in that order.
 * The list's own order is kept per CTA and, roughly, in time (the grid works through it
 * front to back, so CTAs running at once share K/V in L2: sorting the items longest first
 * instead lost 6-10 % on an H200, NOTES v5). Which CTA runs an item never changes a
 * result. Returns 0, or -1 when the scratch memory could not be had (the list is left as
 * it was, which is also correct).
 */
int da_cu_deal(const da_model *m, int brows, int S, int T, const da_attn *attns, da_cu_item *items, int64_t n,
               int64_t grid);

#endif /* DA_CUDA_ITEMS_H */
