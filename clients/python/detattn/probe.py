"""``python3 -m detattn.repro --probe``: does one decode row's output change with the batch it
runs in? In a few seconds, for each attention kernel at hand and each context length: one
query row (one new token over L keys) is computed alone and inside batches of B rows (the
others random, the same length L), and its output bits are compared with the row alone.
Serving stacks decode exactly this way (one unmasked call over the batch's rows), and
split-KV decode kernels choose their split count from B, so a row's bits may depend on how
many other requests are decoding.

Kernels: torch SDPA with one backend enabled (flash, cudnn, efficient, math; on CUDA),
``varlen_attn`` (torch >= 2.10, CUDA) with the batch's rows of equal and of mixed lengths,
matmul-softmax (the CPU fallback), detattnd (when a daemon is given: each trial forks the
row's prefilled sequence), and the model's own matmul in the repro's fixed chunks of rows
against one plain matmul (the control: the repro's model must not vary).
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from .torch import sdpa_backend, _torch_varlen


def _timer(dev: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median microseconds of fn over a few calls, synchronised on ``dev``."""
    def run(fn) -> float:
        fn()
        ts = []
        for _ in range(5):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)
    return run


def _sdpa_kernels(dev: torch.device, scale: float) -> Dict[str, Callable]:
    """name -> fn(q [B,Hq,1,d], k, v [B,Hkv,L,d]) -> o [B,Hq,1,d]."""
    out: Dict[str, Callable] = {}
    if dev.type == "cuda":
        for name in ("flash", "cudnn", "efficient", "math"):
            fn = sdpa_backend(name)
            if fn is not None:
                out[f"sdpa-{name}"] = (lambda f: lambda q, k, v: _gqa(f, q, k, v, scale))(fn)
    else:
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        if sdpa is not None:
            out["sdpa (cpu)"] = lambda q, k, v: sdpa(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                                     v.repeat_interleave(q.shape[1] // k.shape[1], 1))

    def matmul_softmax(q, k, v):
        g = q.shape[1] // k.shape[1]
        K, V = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        return torch.matmul(torch.softmax(torch.matmul(q.float(), K.transpose(-1, -2)) * scale, -1), V).to(q.dtype)
    out["matmul-softmax"] = matmul_softmax
    return out


def _gqa(fn, q, k, v, scale):
    try:
        return fn(q, k, v, False, scale, True)
    except (RuntimeError, TypeError):
        g = q.shape[1] // k.shape[1]
        return fn(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), False, scale, False)


def _varlen_kernel(fn, lengths_of: Optional[Callable[[int], List[int]]] = None):
    """varlen_attn over B single-token rows; row b sees lengths_of(B)[b] keys (k and v hold
    enough of them), or all of k's keys."""
    params = inspect.signature(fn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True

    def run(q, k, v):
        B = q.shape[0]
        lens = lengths_of(B) if lengths_of is not None else [k.shape[2]] * B
        Q = q[:, :, 0].contiguous()                       # [B, Hq, d]
        K = torch.cat([k[b, :, :lens[b]].transpose(0, 1) for b in range(B)]).contiguous()
        V = torch.cat([v[b, :, :lens[b]].transpose(0, 1) for b in range(B)]).contiguous()
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(B)], dtype=torch.int32, device=q.device)
        for heads in ("as they are", "repeated"):
            if heads == "repeated":  # a version that wants equal head counts
                g = Q.shape[1] // K.shape[1]
                K, V = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)
            try:
                return fn(Q, K, V, cu_q, cu_k, 1, max(lens), **kw)[:, :, None]
            except RuntimeError:
                if heads == "repeated" or K.shape[1] == Q.shape[1]:
                    raise
    return run


def _mixed_lengths(B: int, L: int) -> List[int]:
    """Row 0 has L keys; the others 1/2 L to 3/2 L (seeded by B: the same for every run)."""
    g = torch.Generator().manual_seed(B)
    return [L] + (torch.randint(max(1, L // 2), L * 3 // 2 + 1, (B - 1,), generator=g)).tolist()


def _compare(fn, q, k, v, batches: List[int], timer) -> dict:
    """Row 0 alone and in each batch size: which sizes change its bits; times at the ends."""
    try:
        ref = fn(q[:1], k[:1], v[:1])[0].clone()
        differ = [B for B in batches if B > 1 and not torch.equal(fn(q[:B], k[:B], v[:B])[0], ref)]
        us = [timer(lambda: fn(q[:B], k[:B], v[:B])) for B in (1, batches[-1])]
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        return {"error": str(e).splitlines()[0][:160] if str(e) else type(e).__name__}
    return {"differs_at": differ, "us": us}


def _detattn_rows(url: str, args, cfg, L: int, batches: List[int], q, k, v) -> dict:
    """The same probe through detattnd: row 0's sequence and the others are prefilled with
    L tokens once; each trial forks them and decodes one token of every row in one Forward."""
    from .client import Client, SeqIO
    Bmax = batches[-1]
    gen = torch.Generator().manual_seed(args.seed + 7)
    dev = q.device

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(dev)

    with Client(url, data_plane=args.data_plane, arena_bytes=args.arena_mib << 20) as c:
        info = c.hello()
        if info.model.n_q_heads != cfg.n_heads or info.model.head_dim != cfg.head_dim:
            return {"error": f"the daemon serves {info.model}, not {args.model}"}
        seqs = []
        for b in range(Bmax):  # prefill: the keys of the torch rows, as [L, Hkv, d] token rows
            s = c.seq_open()
            kk, vv = k[b, :, :L - 1].transpose(0, 1), v[b, :, :L - 1].transpose(0, 1)
            for lo in range(0, L - 1, 2048):
                hi = min(L - 1, lo + 2048)
                c.forward(0, [SeqIO(s, lo, rnd(hi - lo, cfg.n_heads, cfg.head_dim), kk[lo:hi], vv[lo:hi])])
            seqs.append(s)
        new_k, new_v = k[:, :, L - 1].contiguous(), v[:, :, L - 1].contiguous()    # [B, Hkv, d]
        new_q = q[:, :, 0].contiguous()

        def trial(B: int):
            forks = [s.fork() for s in seqs[:B]]
            try:
                outs = c.forward(0, [SeqIO(f, L - 1, new_q[b:b + 1], new_k[b:b + 1], new_v[b:b + 1])
                                     for b, f in enumerate(forks)])
                return outs[0].o
            finally:
                for f in forks:
                    f.close()

        ref = trial(1)
        differ = [B for B in batches if B > 1 and not torch.equal(trial(B).cpu(), ref.cpu())]
        timer = _timer(dev)
        us = [timer(lambda: trial(B)) for B in (1, Bmax)]
        planes = dict(c.forwards)
        for s in seqs:
            s.close()
    return {"differs_at": differ, "us": us, "backend": info.backend, "arch": info.arch, "forwards": planes,
            "note": "us include a fork and close per row"}


def _model_rows(dev: torch.device, dim: int, ffn: int, rows: int, batches: List[int]) -> Dict[str, dict]:
    """The repro model's own matmul: a row alone vs inside T rows, in fixed chunks of
    ``rows`` rows (the repro) and as one matmul (not batch-invariant in general)."""
    from .model import chunked
    g = torch.Generator().manual_seed(5)
    w = torch.randn(ffn, dim, generator=g).to(dev) / dim ** 0.5
    x = torch.randn(max(batches) * 40, dim, generator=g).to(dev)
    out = {}
    label = f"chunks of {rows} rows" if rows > 1 else "one row at a time"
    for name, fn in ((f"model matmul, {label}", lambda t: chunked(
            lambda c: torch.nn.functional.linear(c, w), t, rows) if rows > 1 else torch.cat(
            [torch.nn.functional.linear(t[i:i + 1], w) for i in range(t.shape[0])])),
                     ("model matmul, one call per step", lambda t: torch.nn.functional.linear(t, w))):
        ref = fn(x[:1])[0]
        sizes = sorted({B * 40 for B in batches} | {1 + B for B in batches})
        out[name] = {"differs_at": [T for T in sizes if T > 1 and not torch.equal(fn(x[:T])[0], ref)],
                     "us": [], "rows": "T rows"}
    return out


def run_probe(args, cfg, url: Optional[str]) -> dict:
    """The probe's result: for each context L and kernel, the batch sizes at which row 0's
    bits differ from the row alone, and microseconds per call at B = 1 and the largest B."""
    dev = torch.device(args.torch_device)
    batches = sorted(set(args.probe_batches) | {1})
    contexts = args.probe_contexts or [args.prompt_len, args.prompt_len + 1]
    scale = cfg.head_dim ** -0.5
    timer = _timer(dev)
    res = {"device": str(dev), "torch": torch.__version__, "model": args.model, "heads": [cfg.n_heads, cfg.n_kv_heads],
           "head_dim": cfg.head_dim, "batches": batches, "contexts": contexts, "rows": {}}
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
    t0 = time.perf_counter()
    for L in contexts:
        g = torch.Generator().manual_seed(args.seed)
        Bmax = batches[-1]
        Lx = L * 3 // 2  # room for the mixed lengths' longer rows
        q = torch.randn(Bmax, cfg.n_heads, 1, cfg.head_dim, generator=g).to(torch.bfloat16).to(dev)
        kx = torch.randn(Bmax, cfg.n_kv_heads, Lx, cfg.head_dim, generator=g).to(torch.bfloat16).to(dev)
        vx = torch.randn(Bmax, cfg.n_kv_heads, Lx, cfg.head_dim, generator=g).to(torch.bfloat16).to(dev)
        k, v = kx[:, :, :L].contiguous(), vx[:, :, :L].contiguous()
        kernels = _sdpa_kernels(dev, scale)
        vfn = _torch_varlen() if dev.type == "cuda" else None
        if vfn is not None:
            kernels["varlen (rows of equal L)"] = _varlen_kernel(vfn)
            kernels["varlen (rows of mixed L)"] = _varlen_kernel(vfn, lambda B, L=L: _mixed_lengths(B, L))
        for name, fn in kernels.items():
            kk, vv = (kx, vx) if "mixed" in name else (k, v)
            res["rows"][f"{name} @ {L}"] = dict(_compare(fn, q, kk, vv, batches, timer), kernel=name, context=L)
        if url:
            try:
                r = _detattn_rows(url, args, cfg, L, batches, q, k, v)
            except Exception as e:  # reported, not fatal: the torch rows still count
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            res["rows"][f"detattn @ {L}"] = dict(r, kernel="detattn", context=L)
        del q, k, v, kx, vx
    for name, r in _model_rows(dev, cfg.dim, cfg.ffn_dim, args.rows, batches).items():
        res["rows"][name] = dict(r, kernel=name, context=0)
    res["seconds"] = time.perf_counter() - t0
    res["batch_variant"] = sorted({r["kernel"] for r in res["rows"].values() if r.get("differs_at")})
    return res


def print_probe(res: dict) -> None:
    print(f"probe: {res.get('gpu', res['device'])}, torch {res['torch']}, {res['heads'][0]} q / {res['heads'][1]} kv "
          f"heads, d {res['head_dim']}, batch sizes {res['batches'][0]}-{res['batches'][-1]}, "
          f"{res['seconds']:.1f} s")
    print("| kernel | context | row's bits differ from the row alone at batch size | us/call B=1 / B=max |")
    print("|---|--:|---|--:|")
    for r in res["rows"].values():
        if "error" in r:
            what = f"n/a: {r['error']}"
        else:
            d = r["differs_at"]
            what = (", ".join(map(str, d)) + f" ({len(d)} of {len(res['batches']) - 1})") if d else "none (invariant)"
            if r.get("rows"):
                what = "T = " + what
        us = " / ".join(f"{u:.0f}" for u in r.get("us", [])) or "-"
        print(f"| {r['kernel']} | {r['context'] or '-'} | {what} | {us} |")
    print("batch-variant here: " + (", ".join(res["batch_variant"]) or "none"))
