/*
 * item.h — one work item of the CUDA attention kernels, shared by the kernels (through
 * cuda_kernels.h) and the plain-C planning code (items.h) that builds and orders them.
 */
#ifndef DA_CUDA_ITEM_H
#define DA_CUDA_ITEM_H

#include <stdint.h>

/* One CTA of the attention kernel: rows [row0, row0 + 64) (at most 16 for decode blocks)
 * of (attn, kv_head), splits [j0, j1). In-row items cover every split their rows touch and
 * fold them; partial items write each of their splits to its own accumulator slot, except a
 * prefix item (flags DA_CU_ITEM_PREFIX: its block's first item): it folds its splits as an
 * in-row item does and writes each row's fold (fp32 o, lse) to the slot of the row's first
 * split, j0 (the planner makes prefix items only of blocks whose rows all start there), where
 * the combine's left fold goes on (da_cu_citem.jc). A persistent grid deals
 * several items to each CTA (items.h, da_cu_deal). */
#define DA_CU_ITEM_PREFIX 1
typedef struct da_cu_item {
  int32_t attn, kv_head, row0, j0, j1, flags;
} da_cu_item;

#endif /* DA_CUDA_ITEM_H */
