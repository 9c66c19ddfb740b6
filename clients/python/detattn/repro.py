"""The reproducibility experiment: does the same prompt give the same tokens whatever else
the server is batching?

One target prompt is generated greedily N times. Each time, a seeded random set of other
requests (random prompt lengths, outputs and prefill chunkings) is running in the same
continuous-batching engine, and the target joins after a random number of steps with a
random prefill chunking of its own. The model's own matmuls run one row at a time
(batch-invariant), so only attention can make runs differ. Attention runs either through
detattnd or through torch in-process (one padded, masked attention call per layer for the
batch, SDPA where torch has it). For detattn the target is also generated from two client
processes at once and, when the experiment started the daemon itself, across a daemon
restart.

    python3 -m detattn.repro --url ipc:///run/detattn/detattnd.sock --model tiny --samples 50 --json r.json
    python3 -m detattn.repro --detattnd build/bin/detattnd --samples 50 --plot r.png

``--json`` writes ``distinct_completions`` per attention path, the first diverging token,
time per token and the cross-process and restart checks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch

from .client import Client
from .engine import Engine, Request
from .model import CONFIGS, Transformer, daemon_flags
from .torch import DetattnAttention, TorchAttention


def target_prompt(cfg, seed: int, length: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (length,), generator=g).tolist()


def one_sample(model, attn, cfg, prompt, max_new, sample_seed, chunk_choices) -> List[int]:
    """The target's completion next to a random batch (seeded by sample_seed)."""
    rnd = random.Random(sample_seed)
    eng = Engine(model, attn, max_batch_tokens=256, prefill_chunk=rnd.choice(chunk_choices))
    others = []
    for _ in range(rnd.randint(0, 5)):
        p = [rnd.randrange(cfg.vocab) for _ in range(rnd.randint(4, 80))]
        others.append(eng.add(Request(p, rnd.randint(1, 2 * max_new), prefill_chunk=rnd.choice(chunk_choices))))
    join_after = rnd.randint(0, 6)
    target = None
    steps = 0
    while target is None or not target.finished:
        if target is None and steps >= join_after:
            target = eng.add(Request(list(prompt), max_new, prefill_chunk=rnd.choice(chunk_choices)))
        for r in eng.step():
            if r is not target:
                eng.release(r)
        # Requests join and leave while the target runs.
        if rnd.random() < 0.3:
            p = [rnd.randrange(cfg.vocab) for _ in range(rnd.randint(4, 60))]
            eng.add(Request(p, rnd.randint(1, max_new), prefill_chunk=rnd.choice(chunk_choices)))
        steps += 1
    out = list(target.out)
    for r in list(eng.running):
        eng.release(r)
    return out


def first_divergence(completions: List[List[int]]) -> Optional[int]:
    ref, first = completions[0], None
    for c in completions[1:]:
        for i, (a, b) in enumerate(zip(ref, c)):
            if a != b:
                first = i if first is None else min(first, i)
                break
    return first


def run_path(name, model, attn, cfg, prompt, args) -> dict:
    completions, t0, tokens = [], time.perf_counter(), 0
    for i in range(args.samples):
        if args.time_limit and time.perf_counter() - t0 > args.time_limit:
            print(f"{name}: time limit after {i} samples", file=sys.stderr)
            break
        out = one_sample(model, attn, cfg, prompt, args.max_new, args.seed * 1000003 + i, [0, 8, 16, 32, 64])
        completions.append(out)
        tokens += len(out)
        if args.verbose or (i + 1) % 50 == 0:
            print(f"{name}: {i + 1} samples, {len({tuple(c) for c in completions})} distinct, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    secs = time.perf_counter() - t0
    distinct = {tuple(c) for c in completions}
    return {"distinct_completions": len(distinct), "first_divergence": first_divergence(completions),
            "samples": len(completions), "seconds": secs, "ms_per_target_token": 1e3 * secs / max(tokens, 1),
            "completion_0": completions[0], "completions": [list(c) for c in distinct]}


class Daemon:
    """A CPU detattnd for the experiment, on an ipc socket in a temporary directory."""

    def __init__(self, path: str, cfg, threads: int = 0):
        self.dir = tempfile.mkdtemp(prefix="detattn-repro-")
        self.url = f"ipc://{self.dir}/d.sock"
        self.args = [path, "--listen", self.url, "--backend", "cpu", "--kv-tokens", "262144",
                     "--split-tokens", "64", "--tile-tokens", "16", "--threads", str(threads)] + daemon_flags(cfg)
        self.proc = None
        self.start()

    def start(self):
        log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen(self.args, stderr=log)
        for _ in range(200):
            if "listening on" in Path(self.dir, "log").read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError("detattnd exited: " + Path(self.dir, "log").read_text())
            time.sleep(0.05)
        raise RuntimeError("detattnd did not start")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def close(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def find_detattnd() -> Optional[str]:
    here = Path(__file__).resolve()
    for c in [os.environ.get("DETATTND", ""), str(here.parents[3] / "build" / "bin" / "detattnd"),
              shutil.which("detattnd") or ""]:
        if c and os.access(c, os.X_OK):
            return c
    return None


def child_main(args) -> int:
    """A second client process: the target next to its own random batches."""
    cfg = CONFIGS[args.model]
    model = Transformer.random(cfg, args.model_seed)
    if args.weights:
        model.load_safetensors(args.weights)
    prompt = target_prompt(cfg, args.seed, args.prompt_len)
    with Client(args.url) as c:
        attn = DetattnAttention(c)
        outs = [one_sample(model, attn, cfg, prompt, args.max_new, 777 + 31 * args.child + i, [0, 8, 32])
                for i in range(args.samples)]
    print(json.dumps(outs))
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = [p for p in ("detattn", "torch") if p in result["paths"]]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].bar(paths, [result["paths"][p]["distinct_completions"] for p in paths], color=["#2a7", "#c44"][:len(paths)])
    ax[0].set_title(f"distinct completions of one prompt ({result['samples']} runs)")
    for p in paths:
        comps = result["paths"][p]["completions"]
        ref = result["paths"][p]["completion_0"]
        div = [next((i for i, (a, b) in enumerate(zip(ref, c)) if a != b), None) for c in comps]
        div = [d for d in div if d is not None]
        if div:
            ax[1].hist(div, bins=range(0, result["max_new"] + 1), alpha=0.6, label=p)
    ax[1].set_title("first diverging token of each distinct completion")
    ax[1].set_xlabel("token index")
    ax[1].legend() if ax[1].has_data() else ax[1].text(0.5, 0.5, "no divergence", ha="center", transform=ax[1].transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m detattn.repro", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running detattnd whose model matches --model (else --detattnd starts one)")
    ap.add_argument("--detattnd", help="path of detattnd to start a CPU daemon (default: found in build/ or PATH)")
    ap.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--weights", help="a safetensors file with the model's weights (default: seeded random)")
    ap.add_argument("--model-seed", type=int, default=1)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--paths", default="detattn,torch", help="attention paths: detattn,torch")
    ap.add_argument("--torch-device", default="cpu", help="torch in-process attention device (cuda on a GPU)")
    ap.add_argument("--json", help="write the result as JSON")
    ap.add_argument("--plot", help="write a PNG plot")
    ap.add_argument("--no-processes", action="store_true", help="skip the two-process check")
    ap.add_argument("--time-limit", type=float, default=0, help="stop sampling a path after this many seconds")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child >= 0:
        return child_main(args)

    cfg = CONFIGS[args.model]
    torch.manual_seed(0)
    model = Transformer.random(cfg, args.model_seed)
    if args.weights:
        model.load_safetensors(args.weights)
    prompt = target_prompt(cfg, args.seed, args.prompt_len)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    result = {"model": args.model, "samples_asked": args.samples, "max_new": args.max_new, "prompt_len": args.prompt_len,
              "seed": args.seed, "paths": {}, "distinct_completions": {}}
    daemon = None
    try:
        if "detattn" in paths:
            url = args.url
            if not url:
                exe = args.detattnd or find_detattnd()
                if not exe:
                    raise SystemExit("no --url and no detattnd found (give --detattnd PATH)")
                daemon = Daemon(exe, cfg)
                url = daemon.url
            with Client(url) as c:
                m = c.hello().model
                if (m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim) != (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                                                            cfg.head_dim):
                    raise SystemExit(f"the daemon serves {m}, not the {args.model} model")
                attn = DetattnAttention(c)
                r = run_path("detattn", model, attn, cfg, prompt, args)
                result["fingerprint"] = f"{c.info.fingerprint:016x}"
                result["data_plane"] = c.data_plane
            ref = r["completion_0"]
            if not args.no_processes:
                kids = [subprocess.Popen([sys.executable, "-m", "detattn.repro", "--child", str(i), "--url", url,
                                          "--model", args.model, "--model-seed", str(args.model_seed), "--seed",
                                          str(args.seed), "--samples", str(max(1, min(args.samples, 4))),
                                          "--max-new", str(args.max_new), "--prompt-len", str(args.prompt_len)]
                                         + (["--weights", args.weights] if args.weights else []),
                                         stdout=subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[1]))
                        for i in range(2)]
                outs = []
                for k in kids:
                    so, _ = k.communicate(timeout=1800)
                    outs += json.loads(so) if k.returncode == 0 else [None]
                r["two_processes_equal"] = all(o == ref for o in outs)
            if daemon is not None:
                daemon.stop()
                daemon.start()
                with Client(daemon.url) as c:
                    again = one_sample(model, DetattnAttention(c), cfg, prompt, args.max_new, 424242, [0, 16])
                r["restart_equal"] = again == ref
            result["paths"]["detattn"] = r
        if "torch" in paths:
            attn = TorchAttention(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, device=args.torch_device)
            result["paths"]["torch"] = run_path("torch", model, attn, cfg, prompt, args)
            result["torch_attention"] = "sdpa" if attn.sdpa is not None else "matmul-softmax"
            result["torch_version"] = torch.__version__
    finally:
        if daemon is not None:
            daemon.close()
    for p, r in result["paths"].items():
        result["distinct_completions"][p] = r["distinct_completions"]
    result["samples"] = min((r["samples"] for r in result["paths"].values()), default=0)
    print("| attention path | samples | distinct completions | first diverging token | ms per token | checks |")
    print("|---|--:|--:|--:|--:|---|")
    for p, r in result["paths"].items():
        checks = []
        if "two_processes_equal" in r:
            checks.append(f"2 processes {'equal' if r['two_processes_equal'] else 'DIFFER'}")
        if "restart_equal" in r:
            checks.append(f"restart {'equal' if r['restart_equal'] else 'DIFFERS'}")
        fd = r["first_divergence"]
        print(f"| {p} | {r['samples']} | {r['distinct_completions']} | {'-' if fd is None else fd} | "
              f"{r['ms_per_target_token']:.1f} | {', '.join(checks) or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    ok = result["distinct_completions"].get("detattn", 1) == 1 and all(
        result["paths"].get("detattn", {}).get(k, True) for k in ("two_processes_equal", "restart_equal"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
