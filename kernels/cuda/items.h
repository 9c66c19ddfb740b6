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

/* How an attention's blocks run (the backend's plan): in-row (one item a block, folding every
 * split); partial items of `per` splits, the first a prefix item where prefix items are on;
 * or (decode rows that would run in-row in a launch that fills the GPU) a prefix item of the
 * block's splits but its last k and those as one-split items (da_cu_tail_splits). */
enum { DA_CU_INROW, DA_CU_PART_PER, DA_CU_PART_TAIL };

/*
 * How an attention whose rows span two or more splits runs (DA_CU_INROW, _PART_PER or
 * _PART_TAIL), where its partials fit the accumulator slots: as the batch's mode says
 * (DA_SPLIT_INROW, DA_SPLIT_PARTIAL), or with DA_SPLIT_AUTO from the batch's in-row blocks
 * (inrow_ctas, over every attention) against the device's n_sm SMs. Partials below `busy`
 * blocks: on prefill_sm90.cu's decode pipes (sm90_decode) 4/5 of the SMs, since a block
 * in-row is one pipe alone on its SM (~42 GB/s of K/V on an H200) and from ~105 blocks the
 * launch is bound by the device's bandwidth, so partials gain nothing in the kernel while
 * their combine and items cost ~15 us a layer call through the daemon (NOTES.md v5.30: B 8,
 * 64 blocks, L 16k 232 against 322-352 us in-row; B 12, 96, L 16k 281-291 against 358-381,
 * L 4k 133-141 against 119-125; B 16-24 5-11 % longer as partials); on attn.cu 1.5x the SMs
 * (about two resident CTAs an SM, as measured there). From 1.5x the SMs, rows with a tail
 * (tail > 0: da_cu_tail_splits) run DA_CU_PART_TAIL: the tails keep every pipe busy there,
 * while with pipes to spare they start beside the rows' long prefix items and slow them (B 16
 * L 16k, 128 blocks: 287 us against 245 in-row). The bits never depend on the choice.
 */
int da_cu_attn_kind(da_split_mode mode, int64_t inrow_ctas, int n_sm, int sm90_decode, int tail);

/* The splits [j0, j1) of size S that rows [row0, row0 + brows) of attention a see (a row is
 * a (query token, q head of one kv head's group) pair; the rows of one token are adjacent). */
void da_cu_block_splits(const da_model *m, int brows, int S, const da_attn *a, int64_t row0, int *j0, int *j1);

/* The items of the partial blocks of b (partial[i] == DA_CU_PART_PER for attention i; other
 * kinds are not counted) at per splits an item: per kv head, each block of n splits has
 * ceil((n - k) / per) items and its k one-split tail items, k = da_cu_tail_splits(per_tail,
 * n). *n_first (may be NULL) gets the items without the tails. */
int64_t da_cu_partial_items(const da_model *m, int brows, int S, const da_batch *b, const unsigned char *partial,
                            int per, int per_tail, int64_t *n_first);

/*
 * Splits per work item for the blocks of b run as partials (DA_CU_PART_PER). slots is how
 * many items run at once (the persistent grid's pipes, or the resident CTAs of all SMs); the
 * choice is the per whose items (not counting one-split tails) fill the fewest waves of slots,
 * costed in key tiles of T tokens with one tile more per item for its start (so ties go to
 * fewer, longer items). Returns per (1 .. 64) and the item count, tails included, in *n_items
 * (0 when nothing runs as partials).
 */
int da_cu_partial_per(const da_model *m, int brows, int S, int T, const da_batch *b, const unsigned char *partial,
                      int per_tail, int64_t slots, int64_t *n_items);

/*
 * The one-split tail k of a block of n splits, 0 where it has none: tail < 0 the rule, n / 8
 * from 32 splits; tail > 0 that k; and only where n > 2 k. Partial items by ticket: a block's
 * last k splits as one-split items listed after every other item go to the pipes that end
 * their first items early. Two cases take them:
 * - DA_CU_PART_TAIL (DA_CUDA_PREFIX_TAIL): in-row decode blocks of a launch that fills the
 *   GPU (B >= 32) end unevenly, the SMs that draw more bandwidth finish their rows early and
 *   idle (NOTES.md v5.20). Same-run A/B on an H200 (NOTES.md v5.22), the last k of n = 128
 *   splits: k 4 / 8 / 16 B 32 0.994 / 0.990 / 0.985, B 64 0.995 / 0.992 / 0.992; n = 32: k 4
 *   / 8 0.995-0.997; n = 8, k 2: 2-4 % slower.
 * - DA_CU_PART_PER (DA_CUDA_PER_TAIL): a wave of long partial items ends as unevenly (B 8 L
 *   64k: items of 32 splits). k 2 / 4 / 8 / 16 of 128 splits, B 8: 1.016 / 1.008 / 0.991 /
 *   0.988, B 16: 1.004 / 0.993 / 0.987 / 0.982; but B 1 (items of 4 splits): 1.06-1.12
 *   (NOTES.md v5.23), so the planner takes the rule only where items are long.
 */
int da_cu_tail_splits(int tail, int64_t n);

/* The DA_CU_PART_PER tail setting a decode launch by ticket takes: per_tail (DA_CUDA_PER_TAIL)
 * where it is >= 0, else the rule (-1) where the partial items without tails (per0 splits,
 * da_cu_partial_per with no tail) are of 16 splits or more, 0 where shorter (B 1 L 64k: 4
 * splits an item, where tails cost 4-12 %). */
int da_cu_per_tail(int per_tail, int per0);

/* The tail k of a block of n splits run as kind: da_cu_tail_splits of prefix_tail for
 * DA_CU_PART_TAIL, of per_tail for DA_CU_PART_PER, 0 in-row. */
int da_cu_block_tail(int kind, int prefix_tail, int per_tail, int64_t n);

/* Whether every row of the block [r0, r0 + brows) of a starts at split j0, the block's first:
 * only then may the block's first item be a prefix item (the kernels write each row's fold to
 * the slot of split j0). Without a window always; with one a later row may start later. */
int da_cu_prefix_rows(const da_model *m, int brows, int S, const da_attn *a, int64_t r0, int j0);

/* The end of the first item of a block with splits [j0, j1) run as kind, with a tail of k
 * one-split items (da_cu_block_tail): j1 in-row, j1 - k for DA_CU_PART_TAIL, j0 + per (at
 * most j1 - k) for DA_CU_PART_PER. Where that item is a prefix item, its rows' combine goes
 * on from there. */
int da_cu_first_end(int kind, int per, int k, int j0, int j1);

/* Whether pass 0 (in-row items), 1 (partial blocks' first items, and DA_CU_PART_PER's others)
 * or 2 (the one-split tail items of partial blocks, listed after every other item) may have
 * items of kind. */
int da_cu_pass_has(int pass, int kind);

/* Writes to out the items that pass `pass` has of one block and kv head (it's attn, kv_head
 * and row0; splits [j0, j1) of the block, the last k of them its tail) and returns their
 * count: the block's first item (flags DA_CU_ITEM_PREFIX where prefix, partial kinds only),
 * its later ones of per splits (DA_CU_PART_PER), its tail's. Passes 0-2 together cover
 * [j0, j1) once, in order. */
int da_cu_block_items(int pass, int kind, int per, int k, int prefix, da_cu_item it, int j0, int j1,
                      da_cu_item *out);

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
