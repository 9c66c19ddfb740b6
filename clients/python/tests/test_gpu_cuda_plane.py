"""The cuda plane on a GPU: CUDA tensors through detattn_forward_cuda give the same bits as
through shm and copy, in place, ordered by torch's stream, kept alive by async calls.

On the GPU machine (clients/python/gpu_repro.sh runs it; no pytest needed there):
    python3 clients/python/tests/test_gpu_cuda_plane.py --detattnd build-gpu/bin/detattnd --json OUT.json
starts a CUDA detattnd (tiny model) and prints one line per check and a table. Under pytest
(ctest python_detattn) it is skipped without a CUDA device and a CUDA daemon
(DETATTND_CUDA=PATH of a detattnd built with CUDA). Where the daemon or libdetattn has no
cuda plane, the checks that need it say so and are skipped; the others still run (CUDA
tensors then go through host memory, with the same bits).
"""

import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import detattn  # noqa: E402
from detattn import Output, SeqIO  # noqa: E402
from detattn.engine import generate  # noqa: E402
from detattn.model import CONFIGS, Transformer  # noqa: E402
from detattn.repro import Daemon  # noqa: E402
from detattn.torch import DetattnAttention  # noqa: E402

CFG = CONFIGS["tiny"]
HQ, HKV, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim


class Skip(Exception):
    pass


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return (t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)).numpy().tobytes()


def rnd(g: torch.Generator, n: int, heads: int, dev) -> torch.Tensor:
    return torch.randn(n, heads, D, generator=g).to(dev)


def workload(c: detattn.Client, dev, seed: int = 1) -> list:
    """A seeded mix of prefill chunks, batched decode, fork and truncate, with lse; every
    output's bits in order."""
    g = torch.Generator().manual_seed(seed)

    def qkv(n):
        return rnd(g, n, HQ, dev), rnd(g, n, HKV, dev), rnd(g, n, HKV, dev)

    out = []
    seqs = [c.seq_open() for _ in range(3)]
    for s, chunks in zip(seqs, ([37, 1, 64], [5], [130, 2])):
        for n in chunks:
            (o,) = c.forward(0, [SeqIO(s, s.length, *qkv(n))], want_lse=True)
            out.append((bits(o.o), bits(o.lse)))
    for _ in range(6):  # decode: one Forward for all three
        outs = c.forward(0, [SeqIO(s, s.length, *qkv(1)) for s in seqs], want_lse=True)
        out += [(bits(o.o), bits(o.lse)) for o in outs]
    f = seqs[0].fork()
    q, k, v = qkv(3)
    (a,) = c.forward(0, [SeqIO(f, f.length, q, k, v)])
    (b,) = c.forward(0, [SeqIO(seqs[0], seqs[0].length, q, k, v)])
    seqs[0].truncate(seqs[0].length - 3)
    (again,) = c.forward(0, [SeqIO(seqs[0], seqs[0].length, q, k, v)])
    assert bits(a.o) == bits(b.o) == bits(again.o), "fork or truncate changed a bit"
    out.append((bits(a.o), b""))
    for s in seqs + [f]:
        s.close()
    return out


def cuda_offered(c: detattn.Client, dev) -> bool:
    return c.cuda_plane_for(dev)


def check_planes_equal(url: str, dev, report: dict) -> None:
    """The workload with CUDA tensors through copy, shm, auto and (if offered) cuda: equal."""
    res, used = {}, {}
    for plane in ("copy", "shm", "auto", "cuda"):
        try:
            with detattn.Client(url, data_plane=plane) as c:
                c.hello()
                res[plane] = workload(c, dev)
                used[plane] = dict(c.forwards, data_plane=c.data_plane)
        except detattn.FailedPrecondition as e:
            used[plane] = f"refused: {e.message}"
    report["planes"] = used
    ref = res["copy"]
    for plane, r in res.items():
        if r != ref:
            diff = sum(a != b for a, b in zip(r, ref))
            raise AssertionError(f"{plane}: {diff} of {len(ref)} outputs differ from copy")
    if "cuda" not in res:
        report["planes_note"] = "no cuda plane here: copy, shm, auto (host path) compared"
    elif used["auto"]["cuda"] == 0 or used["cuda"]["cuda"] == 0:
        raise AssertionError(f"the cuda plane is offered but auto/cuda did not use it: {used}")


def check_in_place_and_async(url: str, dev, report: dict) -> None:
    """Outputs on the device in the model dtype; out= written in place; an async call keeps
    float32 inputs that the caller dropped (converted on the device) alive until it is
    waited for, while the allocator is pushed to reuse memory."""
    with detattn.Client(url) as c:
        c.hello()
        if not cuda_offered(c, dev):
            raise Skip("the daemon or libdetattn offers no cuda plane")
        g = torch.Generator().manual_seed(3)
        q, k, v = rnd(g, 50, HQ, dev), rnd(g, 50, HKV, dev), rnd(g, 50, HKV, dev)
        with c.seq_open() as s:
            (ref,) = c.forward(0, [SeqIO(s, 0, q, k, v)], want_lse=True)
        assert ref.o.device == q.device and ref.o.dtype == torch.bfloat16 and ref.o.is_contiguous()
        assert ref.lse.device == q.device and ref.lse.dtype == torch.float32
        o_buf = torch.empty(50, HQ, D, dtype=torch.bfloat16, device=dev)
        ptr = o_buf.data_ptr()
        with c.seq_open() as s:
            (x,) = c.forward(0, [SeqIO(s, 0, q, k, v)], out=[Output(o_buf)])
        assert x.o is o_buf and o_buf.data_ptr() == ptr and bits(o_buf) == bits(ref.o)
        with c.seq_open() as s:
            call = c.forward_async(0, [SeqIO(s, 0, q.clone(), k.clone(), v.clone())])
            gc.collect()
            junk = [torch.full((50, HQ, D), 3.0, dtype=torch.bfloat16, device=dev) for _ in range(256)]
            (y,) = call.result()
            del junk
        assert bits(y.o) == bits(ref.o)
        report["forwards"] = dict(c.forwards)


def check_stream_order(url: str, dev, report: dict) -> None:
    """Inputs made by slow work queued on a side stream just before the call, outputs used
    by work queued right after it on that stream: the daemon reads after the former and the
    latter sees its writes."""
    with detattn.Client(url) as c:
        c.hello()
        if not cuda_offered(c, dev):
            raise Skip("the daemon or libdetattn offers no cuda plane")
        g = torch.Generator().manual_seed(4)
        a = torch.randn(4096, 4096, generator=g).to(dev)
        base = rnd(g, 64, HQ, dev)
        k, v = rnd(g, 64, HKV, dev), rnd(g, 64, HKV, dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), c.seq_open() as s:
            x = a
            for _ in range(30):  # tens of milliseconds of work before q exists
                x = torch.tanh(x @ a * 1e-3)
            q = base + x[:64, :HQ * D].reshape(64, HQ, D) * 0.0 + x[0, 0] * 0.0
            (o,) = c.forward(0, [SeqIO(s, 0, q, k, v)])
            after = o.o.float() * 2.0  # queued on the side stream after the call
        torch.cuda.synchronize(dev)
        with detattn.Client(url, data_plane="copy") as c2, c2.seq_open() as s2:
            (ref,) = c2.forward(0, [SeqIO(s2, 0, q, k, v)])
        assert bits(o.o) == bits(ref.o), "the daemon read q before the side stream's work made it"
        assert torch.equal(after, ref.o.to(dev).float() * 2.0), "work after the call did not see the outputs"


def check_model_steps(url: str, dev, report: dict) -> None:
    """The tiny model on the GPU generating through DetattnAttention: the cuda plane (no host
    copies: every layer call a device call) and shm give the same tokens."""
    model = Transformer.random(CFG, 1).to(dev)
    model.set_rows(64)
    prompt = list(range(3, 40))
    outs = {}
    for plane in ("shm", "auto"):
        with detattn.Client(url, data_plane=plane) as c:
            att = DetattnAttention(c)
            outs[plane] = generate(model, att, prompt, 12, prefill_chunk=16)
            report[f"model_{plane}"] = {"device_calls": att.device_calls, "host_calls": att.host_calls}
            if plane == "auto" and cuda_offered(c, dev):
                assert att.host_calls == 0 and att.device_calls > 0, report[f"model_{plane}"]
    assert outs["shm"] == outs["auto"], outs


CHECKS = [check_planes_equal, check_in_place_and_async, check_stream_order, check_model_steps]


def run_all(url: str) -> dict:
    dev = torch.device("cuda", 0)
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev), "checks": {}}
    with detattn.Client(url) as c:
        info = c.hello()
        report["daemon"] = {"backend": info.backend, "arch": info.arch, "planes": list(info.data_planes)}
    report["libdetattn_has_cuda_plane"] = detattn._lib.cuda_api() is not None
    for fn in CHECKS:
        name = fn.__name__[len("check_"):]
        t = time.perf_counter()
        try:
            fn(url, dev, report)
            status = "PASS"
        except Skip as e:
            status = f"SKIP ({e})"
        except Exception as e:  # noqa: BLE001 - every check reports
            traceback.print_exc()
            status = f"FAIL ({type(e).__name__}: {str(e)[:300]})"
        report["checks"][name] = status
        print(f"{name}: {status} ({time.perf_counter() - t:.1f} s)", flush=True)
    return report


# ---- pytest (skipped without a GPU and a CUDA detattnd) ----
try:
    import pytest
except ImportError:  # the GPU machine may have no pytest: main() below
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def cuda_url():
        exe = os.environ.get("DETATTND_CUDA")
        if not torch.cuda.is_available() or not exe:
            pytest.skip("needs a CUDA device and DETATTND_CUDA (a detattnd built with CUDA)")
        d = Daemon(exe, CFG, backend="cuda")
        yield d.url
        d.close()

    @pytest.mark.parametrize("fn", CHECKS, ids=[f.__name__ for f in CHECKS])
    def test_gpu(cuda_url, fn):
        try:
            fn(cuda_url, torch.device("cuda", 0), {})
        except Skip as e:
            pytest.skip(str(e))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running CUDA detattnd serving the tiny model")
    ap.add_argument("--detattnd", help="start this detattnd with --backend cuda")
    ap.add_argument("--json")
    ap.add_argument("--daemon-log", help="keep the started daemon's log in this file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the daemon
    d = Daemon(a.detattnd, CFG, backend="cuda", keep_log=a.daemon_log) if not a.url else None
    try:
        report = run_all(a.url or d.url)
    finally:
        if d is not None:
            d.close()
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    print("| check | result |\n|---|---|")
    for k, v in report["checks"].items():
        print(f"| {k} | {v} |")
    print(f"planes used: {json.dumps(report.get('planes', {}))}")
    return 1 if any(v.startswith("FAIL") for v in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
