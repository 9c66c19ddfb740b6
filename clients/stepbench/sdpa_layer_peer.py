"""Per-layer decode attention time of PyTorch SDPA in-process (flash and cuDNN backends) on
the shapes of detattn-step-bench: q [B, Hq, 1, d], K/V [B, Hkv, L, d] bf16 on the GPU, timed
with CUDA events after warm-up (median of --iters). Writes CSV rows backend,B,L,us."""

import argparse
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_us(fn, iters):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1024,1x4096,1x16384,8x1024,8x4096,8x16384,64x1024,64x4096,64x16384")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    print("backend,B,L,us")
    for sh in a.shapes.split(","):
        B, L = (int(x) for x in sh.split("x"))
        q = torch.randn(B, a.hq, 1, a.d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, a.hkv, L, a.d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, a.hkv, L, a.d, device="cuda", dtype=torch.bfloat16)
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    us = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                 a.iters)
                print(f"{name},{B},{L},{us:.2f}")
            except RuntimeError as e:
                print(f"# {name} B {B} L {L}: {e}".replace("\n", " ")[:200], file=sys.stderr)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
