"""The reproducibility experiment: does the same prompt give the same tokens whatever else
the server is batching?

The same target prompt is generated greedily N times by a continuous-batching engine that
is also serving other requests. The model's own ops run in fixed row shapes
(batch-invariant), so only attention can make runs differ. Two workloads:

  batches  (the CPU default) N runs; in each a seeded random set of other requests (short
           prompts, random outputs and prefill chunkings) runs in the same engine and the
           target joins after a random number of steps with a random chunking of its own.
  stream   (for the GPU) one long seeded stream of requests joining and leaving: bursts of
           requests with prompts of equal length arrive (a burst is prefilled in one step),
           some bursts carry copies of the target prompt; the arrival rate changes every
           40 steps, so the batch swings from a few rows to --running. Each target copy is
           one sample. With long prompts (--prompt-len 2048) decode runs over long contexts,
           where torch's decode kernels choose their KV splits from the batch size.

Attention runs through one of the paths:

  detattn              detattnd: one Forward per layer per step for the whole batch (CUDA
                       tensors through the cuda plane when the daemon offers it)
  torch                torch in-process, one padded, masked call per layer (SDPA where
                       torch has it, else matmul-softmax)
  torch-varlen         one packed varlen_attn call per layer for the whole step
  torch-flash          serving-style decode: decode rows in groups of equal KV length, each
  torch-cudnn          group ONE unmasked SDPA call with only that backend enabled
  torch-varlen-decode  prefill rows in one varlen_attn call, all decode rows in another
                       (max_seqlen_q 1), as vLLM-style engines decode (CUDA, torch >= 2.10)

For detattn the target is also generated from two client processes at once and, when the
experiment started the daemon itself, across a daemon restart. ``--probe`` first checks, in
a few seconds, whether one row's decode output bits change with the batch size for each
kernel at the chosen context.

    python3 -m detattn.repro --url ipc:///run/detattn/detattnd.sock --model tiny --samples 50 --json r.json
    python3 -m detattn.repro --detattnd build/bin/detattnd --samples 50 --plot r.png
    python3 -m detattn.repro --detattnd build-gpu/bin/detattnd --backend cuda --torch-device cuda \\
        --model small --workload stream --prompt-len 2048 --max-new 32 --samples 1000 \\
        --paths detattn,torch-flash,torch-cudnn,torch-varlen-decode --time-budget 300 --json r.json

``--json`` writes ``distinct_completions`` per attention path, the first diverging token,
``distinct_logit_traces`` (the bits of every logits row sampled from), time per token and
step, and the cross-process and restart checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .client import Client
from .engine import Engine, Request
from .model import CONFIGS, Transformer, daemon_flags
from .torch import DetattnAttention, TorchAttention


PATHS = ("detattn", "torch", "torch-varlen", "torch-flash", "torch-cudnn", "torch-varlen-decode")
#: Arrival probability per step in the stream workload, redrawn every PHASE_STEPS steps.
ARRIVAL_RATES = (0.03, 0.1, 0.25, 0.5)
PHASE_STEPS = 40


def _range(text: str) -> Tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI with 1 <= LO <= HI")
    return lo, hi


def _ints(text: str) -> List[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return out


def target_prompt(cfg, seed: int, length: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (length,), generator=g).tolist()


def _tokens(rnd: random.Random, vocab: int, n: int) -> List[int]:
    g = torch.Generator().manual_seed(rnd.getrandbits(63))
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def one_sample(model, attn, cfg, prompt, max_new, sample_seed, chunk_choices,
               other_len: Tuple[int, int] = (4, 80), stats: Optional[dict] = None) -> List[int]:
    """The batches workload: the target's completion next to a random batch (seeded by
    sample_seed): 0-5 other requests at the start, more joining (30 % a step) while the
    target runs, prompts of other_len tokens, random output lengths and prefill chunkings."""
    rnd = random.Random(sample_seed)
    eng = Engine(model, attn, max_batch_tokens=256, prefill_chunk=rnd.choice(chunk_choices))
    lo, hi = other_len
    for _ in range(rnd.randint(0, 5)):
        p = [rnd.randrange(cfg.vocab) for _ in range(rnd.randint(lo, hi))]
        eng.add(Request(p, rnd.randint(1, 2 * max_new), prefill_chunk=rnd.choice(chunk_choices)))
    join_after = rnd.randint(0, 6)
    target = None
    steps = 0
    while target is None or not target.finished:
        if target is None and steps >= join_after:
            target = eng.add(Request(list(prompt), max_new, prefill_chunk=rnd.choice(chunk_choices)))
            target.trace = hashlib.blake2b(digest_size=16)
        for r in eng.step():
            if r is not target:
                eng.release(r)
        # Requests join and leave while the target runs.
        if rnd.random() < 0.3:
            p = [rnd.randrange(cfg.vocab) for _ in range(rnd.randint(lo, hi))]
            eng.add(Request(p, rnd.randint(1, max_new), prefill_chunk=rnd.choice(chunk_choices)))
        steps += 1
    out = list(target.out)
    for r in list(eng.running):
        eng.release(r)
    if stats is not None:
        stats["steps"] = stats.get("steps", 0) + eng.steps
        stats["tokens"] = stats.get("tokens", 0) + eng.tokens
        stats["decode_tokens"] = stats.get("decode_tokens", 0) + eng.decode_tokens
        stats.setdefault("traces", []).append(target.trace.hexdigest())
    return out


def run_stream(model, attn, cfg, prompt: List[int], n_targets: int, seed: int, max_new: int, burst: int,
               running: int, other_len: Tuple[int, int], batch_tokens: int, time_limit: float = 0.0,
               name: str = "", progress: bool = False) -> dict:
    """The stream workload: ``n_targets`` copies of ``prompt`` served among seeded random
    other requests (see the module docstring). The arrivals, prompt lengths and output
    lengths depend only on ``seed``, never on the tokens, so every attention path sees the
    same sequence of batches. After ``time_limit`` seconds no new request starts; the
    targets running finish. Returns the targets' completions and logits traces (in the
    order they finished) and the engine's counters."""
    rnd = random.Random(seed)
    P = len(prompt)
    eng = Engine(model, attn, max_batch_tokens=batch_tokens, prefill_chunk=max(P, other_len[1]), whole_chunks=True)
    queue: deque = deque()
    targets: Dict[int, Request] = {}
    done: List[Request] = []
    launched, waiting, step, rate, stop = 0, 0, 0, ARRIVAL_RATES[0], False  # waiting: targets queued or running
    t0 = time.perf_counter()
    last_report = t0
    while True:
        now = time.perf_counter()
        if not stop and time_limit and now - t0 > time_limit:
            stop = True
            waiting -= sum(1 for b in queue for r in b if r.id in targets)
            queue.clear()
            if progress:
                print(f"{name}: time limit: {len(done)} samples done, finishing the {waiting} running",
                      file=sys.stderr, flush=True)
        if step % PHASE_STEPS == 0:
            rate = rnd.choice(ARRIVAL_RATES)
        if not stop and launched < n_targets and len(queue) < 2 and rnd.random() < rate:
            k = rnd.randint(1, burst)
            reqs = []
            if rnd.random() < 0.5:  # a burst with the target: the others' prompts are as long
                for i in range(k):
                    if launched < n_targets and (i == 0 or rnd.random() < 0.5):
                        r = Request(list(prompt), max_new)
                        r.trace = hashlib.blake2b(digest_size=16)
                        targets[r.id] = r
                        launched += 1
                        waiting += 1
                    else:
                        r = Request(_tokens(rnd, cfg.vocab, P), rnd.randint(1, 2 * max_new))
                    reqs.append(r)
            else:
                n = rnd.randint(*other_len)
                reqs = [Request(_tokens(rnd, cfg.vocab, n), rnd.randint(1, 2 * max_new)) for _ in range(k)]
            queue.append(reqs)
        while queue and (len(eng.running) + len(queue[0]) <= running or not eng.running):
            for r in queue.popleft():
                eng.add(r)
        if eng.running:
            for r in eng.step():
                eng.release(r)
                if r.id in targets:
                    done.append(r)
                    waiting -= 1
        step += 1
        if progress and time.perf_counter() - last_report > 30:
            last_report = time.perf_counter()
            print(f"{name}: {len(done)} samples, step {step}, {last_report - t0:.0f} s", file=sys.stderr, flush=True)
        if (stop or launched >= n_targets) and waiting == 0:
            break
    for r in list(eng.running):
        eng.release(r)
    return {"completions": [list(r.out) for r in done], "traces": [r.trace.hexdigest() for r in done],
            "steps": eng.steps, "tokens": eng.tokens, "decode_tokens": eng.decode_tokens,
            "seconds": time.perf_counter() - t0}


def first_divergence(completions: List[List[int]]) -> Optional[int]:
    if not completions:
        return None
    ref, first = completions[0], None
    for c in completions[1:]:
        for i, (a, b) in enumerate(zip(ref, c)):
            if a != b:
                first = i if first is None else min(first, i)
                break
    return first


def summarize(completions: List[List[int]], traces: List[str], secs: float, steps: int, tokens: int,
              decode_tokens: int) -> dict:
    distinct = {tuple(c) for c in completions}
    target_tokens = sum(len(c) for c in completions)
    return {"distinct_completions": len(distinct), "first_divergence": first_divergence(completions),
            "distinct_logit_traces": len(set(traces)), "samples": len(completions), "seconds": secs,
            "ms_per_target_token": 1e3 * secs / max(target_tokens, 1), "engine_steps": steps,
            "engine_tokens": tokens, "engine_decode_tokens": decode_tokens,
            "ms_per_step": 1e3 * secs / max(steps, 1), "engine_tokens_per_s": tokens / max(secs, 1e-9),
            "completion_0": completions[0] if completions else [],
            "completions": [list(c) for c in sorted(distinct)]}


def run_path(name, model, attn, cfg, prompt, args, time_limit: float) -> dict:
    """N samples of the target through one attention path, in the chosen workload."""
    if args.workload == "stream":
        s = run_stream(model, attn, cfg, prompt, args.samples, args.seed * 1000003, args.max_new, args.burst,
                       args.running, args.other_len, args.batch_tokens, time_limit, name, progress=True)
        return summarize(s["completions"], s["traces"], s["seconds"], s["steps"], s["tokens"], s["decode_tokens"])
    completions, t0, stats = [], time.perf_counter(), {}
    for i in range(args.samples):
        if time_limit and time.perf_counter() - t0 > time_limit:
            print(f"{name}: time limit after {i} samples", file=sys.stderr)
            break
        completions.append(one_sample(model, attn, cfg, prompt, args.max_new, args.seed * 1000003 + i,
                                      [0, 8, 16, 32, 64], args.other_len, stats))
        if args.verbose or (i + 1) % 50 == 0:
            print(f"{name}: {i + 1} samples, {len({tuple(c) for c in completions})} distinct, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return summarize(completions, stats.get("traces", []), time.perf_counter() - t0, stats.get("steps", 0),
                     stats.get("tokens", 0), stats.get("decode_tokens", 0))


class Daemon:
    """A detattnd for the experiment, on an ipc socket in a temporary directory: the CPU
    backend (as in CI), or ``backend="cuda"`` with the CUDA kernels' tile; ``extra``: more
    flags."""

    def __init__(self, path: str, cfg, threads: int = 0, backend: str = "cpu", extra: Optional[List[str]] = None,
                 keep_log: Optional[str] = None):
        self.keep_log = keep_log  # where close() copies the daemon's log
        self.dir = tempfile.mkdtemp(prefix="detattn-repro-")
        self.url = f"ipc://{self.dir}/d.sock"
        numerics = (["--split-tokens", "64", "--tile-tokens", "16", "--threads", str(threads)] if backend == "cpu"
                    else ["--split-tokens", "256", "--tile-tokens", "64"])
        self.args = ([path, "--listen", self.url, "--backend", backend, "--kv-tokens", "262144"] + numerics
                     + daemon_flags(cfg) + list(extra or []))
        self.proc = None
        self.start()

    @property
    def log(self) -> str:
        return Path(self.dir, "log").read_text(errors="replace")

    def start(self):
        log = open(os.path.join(self.dir, "log"), "a")
        self.proc = subprocess.Popen(self.args, stderr=log)
        for _ in range(1200):
            if self.log.count("listening on") > getattr(self, "_starts", 0):
                self._starts = self.log.count("listening on")
                return
            if self.proc.poll() is not None:
                raise RuntimeError("detattnd exited: " + self.log[-3000:])
            time.sleep(0.05)
        raise RuntimeError("detattnd did not start: " + self.log[-3000:])

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)

    def close(self):
        self.stop()
        if self.keep_log:
            shutil.copyfile(os.path.join(self.dir, "log"), self.keep_log)
        shutil.rmtree(self.dir, ignore_errors=True)


def find_detattnd() -> Optional[str]:
    here = Path(__file__).resolve()
    for c in [os.environ.get("DETATTND", ""), str(here.parents[3] / "build" / "bin" / "detattnd"),
              shutil.which("detattnd") or ""]:
        if c and os.access(c, os.X_OK):
            return c
    return None


def make_model(args, cfg) -> Transformer:
    """The seeded model on --torch-device, its own ops in fixed row shapes (--rows)."""
    model = Transformer.random(cfg, args.model_seed)
    if args.weights:
        model.load_safetensors(args.weights)
    dev = torch.device(args.torch_device)
    model = model.to(dev)
    model.set_rows(args.rows if args.rows >= 0 else (256 if dev.type == "cuda" else 1))
    return model


def detattn_client(url: str, args) -> Client:
    return Client(url, data_plane=args.data_plane, arena_bytes=args.arena_mib << 20)


def child_main(args) -> int:
    """A second client process: the target next to its own load; prints its completions."""
    cfg = CONFIGS[args.model]
    model = make_model(args, cfg)
    prompt = target_prompt(cfg, args.seed, args.prompt_len)
    with detattn_client(args.url, args) as c:
        attn = DetattnAttention(c)
        if args.workload == "stream":
            outs = run_stream(model, attn, cfg, prompt, args.samples, 777 + 31 * args.child, args.max_new, args.burst,
                              args.running, args.other_len, args.batch_tokens, args.time_limit)["completions"]
        else:
            outs = [one_sample(model, attn, cfg, prompt, args.max_new, 777 + 31 * args.child + i, [0, 8, 32],
                               args.other_len) for i in range(args.samples)]
    print(json.dumps(outs))
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = [p for p in PATHS if p in result["paths"]]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].bar(paths, [result["paths"][p]["distinct_completions"] for p in paths],
              color=["#2a7", "#c44", "#e83", "#a4c", "#48c", "#886"][:len(paths)])
    ax[0].set_title(f"distinct completions of one prompt (<= {result['samples_asked']} runs)")
    ax[0].tick_params(axis="x", labelrotation=20)
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


def torch_backend(name: str, cfg, args) -> TorchAttention:
    """The in-process attention of path ``name`` (every path but detattn)."""
    dev = torch.device(args.torch_device)
    if args.torch_dtype == "auto":  # what a serving stack computes in: bf16 on a GPU
        compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        compute = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.torch_dtype]
    kind = "padded" if name == "torch" else name[len("torch-"):]
    return TorchAttention(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, device=dev,
                          compute_dtype=compute, kind=kind)


def _child_cmd(args, url: str, i: int, samples: int) -> List[str]:
    return ([sys.executable, "-m", "detattn.repro", "--child", str(i), "--url", url, "--model", args.model,
             "--model-seed", str(args.model_seed), "--seed", str(args.seed), "--samples", str(samples),
             "--max-new", str(args.max_new), "--prompt-len", str(args.prompt_len), "--other-len",
             "%d:%d" % args.other_len, "--workload", args.workload, "--torch-device", args.torch_device,
             "--rows", str(args.rows), "--data-plane", args.data_plane, "--arena-mib", str(args.arena_mib),
             "--burst", str(args.burst), "--running", str(args.running), "--batch-tokens", str(args.batch_tokens),
             "--time-limit", str(args.check_seconds)]
            + (["--weights", args.weights] if args.weights else []))


def detattn_checks(args, url: str, daemon: Optional[Daemon], model, cfg, prompt, ref: List[int]) -> dict:
    """The target from two client processes at once, and after a daemon restart."""
    out = {}
    if not args.no_processes:
        n = max(1, min(args.samples, 4))
        kids = [subprocess.Popen(_child_cmd(args, url, i, n), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 cwd=str(Path(__file__).resolve().parents[1])) for i in range(2)]
        outs, errs = [], []
        for k in kids:
            so, se = k.communicate(timeout=max(600, 4 * args.check_seconds))
            if k.returncode == 0:
                outs += json.loads(so)
            else:
                outs.append(None)
                errs.append(se.decode(errors="replace")[-1500:])
        out["two_processes_equal"] = bool(outs) and all(o == ref for o in outs)
        out["two_processes_samples"] = len(outs)
        if errs:
            out["two_processes_errors"] = errs
            print("detattn: a child process failed:\n" + "\n".join(errs), file=sys.stderr)
    if daemon is not None:
        daemon.stop()
        daemon.start()
        with detattn_client(daemon.url, args) as c:
            attn = DetattnAttention(c)
            if args.workload == "stream":
                again = run_stream(model, attn, cfg, prompt, 3, 424242, args.max_new, args.burst, args.running,
                                   args.other_len, args.batch_tokens, args.check_seconds)["completions"]
            else:
                again = [one_sample(model, attn, cfg, prompt, args.max_new, 424242, [0, 16], args.other_len)]
        out["restart_equal"] = bool(again) and all(a == ref for a in again)
    return out


def run_detattn(args, cfg, model, prompt, daemon: Optional[Daemon], url: str, time_limit: float) -> dict:
    with detattn_client(url, args) as c:
        m = c.hello().model
        if (m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim) != (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                                                    cfg.head_dim):
            raise SystemExit(f"the daemon serves {m}, not the {args.model} model")
        attn = DetattnAttention(c)
        r = run_path("detattn", model, attn, cfg, prompt, args, time_limit)
        info = c.info
        r["attention"] = {"backend": info.backend, "arch": info.arch, "fingerprint": f"{info.fingerprint:016x}",
                          "split_tokens": info.split_tokens, "tile_tokens": info.tile_tokens,
                          "data_plane": c.data_plane, "planes_offered": list(info.data_planes),
                          "forwards": dict(c.forwards), "device_calls": attn.device_calls,
                          "host_calls": attn.host_calls}
    if r["samples"]:
        r.update(detattn_checks(args, url, daemon, model, cfg, prompt, r["completion_0"]))
    return r


def print_table(result: dict) -> None:
    print("| attention path | samples | distinct completions | first diverging token | distinct logit traces | "
          "ms per step | decode tokens/s | checks |")
    print("|---|--:|--:|--:|--:|--:|--:|---|")
    for p, r in result["paths"].items():
        checks = []
        if "two_processes_equal" in r:
            checks.append(f"2 processes {'equal' if r['two_processes_equal'] else 'DIFFER'}")
        if "restart_equal" in r:
            checks.append(f"restart {'equal' if r['restart_equal'] else 'DIFFERS'}")
        a = r.get("attention", {})
        if "data_plane" in a:
            checks.append(f"plane {a['data_plane']} ({a['device_calls']} device / {a['host_calls']} host calls)")
        if a.get("decode_batches"):
            sizes = sorted(int(b) for b in a["decode_batches"])
            checks.append(f"decode batches {sizes[0]}-{sizes[-1]} rows")
        fd = r["first_divergence"]
        dec = r["engine_decode_tokens"] / max(r["seconds"], 1e-9)
        print(f"| {p} | {r['samples']} | {r['distinct_completions']} | {'-' if fd is None else fd} | "
              f"{r['distinct_logit_traces']} | {r['ms_per_step']:.1f} | {dec:.0f} | {', '.join(checks) or '-'} |")
    for p, why in result["skipped"].items():
        print(f"| {p} | skipped: {why} | | | | | | |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m detattn.repro", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running detattnd whose model matches --model (else --detattnd starts one)")
    ap.add_argument("--detattnd", help="path of detattnd to start (default: found in build/ or PATH)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"), help="backend of the daemon started here")
    ap.add_argument("--daemon-arg", action="append", default=[], help="another flag for the daemon started here")
    ap.add_argument("--daemon-log", help="keep the log of the daemon started here in this file")
    ap.add_argument("--data-plane", default="auto", choices=("auto", "copy", "shm", "cuda"),
                    help="the detattn client's data plane (auto: cuda for CUDA tensors when offered, else shm)")
    ap.add_argument("--arena-mib", type=int, default=512, help="the detattn client's shared-memory arena")
    ap.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--weights", help="a safetensors file with the model's weights (default: seeded random)")
    ap.add_argument("--model-seed", type=int, default=1)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=48, help="tokens of the target prompt")
    ap.add_argument("--other-len", type=_range, default=None, metavar="LO:HI",
                    help="prompt tokens of the other requests (default 4:80; stream: P/2:3P/2 for the bursts "
                         "without the target)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workload", default="batches", choices=("batches", "stream"))
    ap.add_argument("--burst", type=int, default=12, help="stream: most requests arriving at once")
    ap.add_argument("--running", type=int, default=48, help="stream: most requests running at once")
    ap.add_argument("--batch-tokens", type=int, default=32768, help="stream: most tokens in one engine step")
    ap.add_argument("--paths", default="detattn,torch", help="attention paths, of " + ",".join(PATHS))
    ap.add_argument("--torch-device", default="cpu", help="device of the model and the in-process attention")
    ap.add_argument("--rows", type=int, default=-1,
                    help="the model's ops in fixed chunks of this many rows (default: 1 on the CPU, 256 on CUDA)")
    ap.add_argument("--torch-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="what the padded torch path computes in (auto: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--json", help="write the result as JSON")
    ap.add_argument("--plot", help="write a PNG plot")
    ap.add_argument("--no-processes", action="store_true", help="skip the two-process check")
    ap.add_argument("--time-limit", type=float, default=0, help="stop sampling a path after this many seconds")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds for all paths together (each gets an even share of what is left)")
    ap.add_argument("--check-seconds", type=float, default=60, help="time limit of each detattn check run")
    ap.add_argument("--probe", action="store_true",
                    help="only check whether one decode row's bits change with the batch size, per kernel")
    ap.add_argument("--probe-batches", type=_ints, default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32],
                    help="batch sizes the probe tries")
    ap.add_argument("--probe-contexts", type=_ints, default=None, help="KV lengths the probe tries "
                    "(default: --prompt-len and --prompt-len + 1)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.other_len is None:
        args.other_len = ((max(1, args.prompt_len // 2), args.prompt_len * 3 // 2) if args.workload == "stream"
                          else (4, 80))
    if args.rows < 0:
        args.rows = 256 if torch.device(args.torch_device).type == "cuda" else 1
    if args.child >= 0:
        return child_main(args)

    cfg = CONFIGS[args.model]
    torch.manual_seed(0)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        ap.error(f"unknown attention path {bad[0]!r} (of {', '.join(PATHS)})")
    daemon = None
    url = args.url
    try:
        if (("detattn" in paths and not args.probe) or (args.probe and args.detattnd)) and not url:
            exe = args.detattnd or find_detattnd()
            if not exe:
                raise SystemExit("no --url and no detattnd found (give --detattnd PATH)")
            extra = list(args.daemon_arg)
            if args.workload == "stream" and not any(a.startswith("--max-request-tokens") for a in extra):
                held = args.running * (max(args.other_len[1], args.prompt_len) + 2 * args.max_new)
                extra += ["--max-request-tokens", str(args.batch_tokens), "--max-batch-tokens",
                          str(args.batch_tokens + 1024), "--kv-tokens", str(max(262144, 2 * held))]
            daemon = Daemon(exe, cfg, backend=args.backend, extra=extra, keep_log=args.daemon_log)
            url = daemon.url
        if args.probe:
            from .probe import print_probe, run_probe
            res = run_probe(args, cfg, url)
            print_probe(res)
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=1))
            return 0
        return experiment(args, cfg, paths, daemon, url)
    finally:
        if daemon is not None:
            daemon.close()


def experiment(args, cfg, paths: List[str], daemon: Optional[Daemon], url: Optional[str]) -> int:
    model = make_model(args, cfg)
    prompt = target_prompt(cfg, args.seed, args.prompt_len)
    result = {"model": args.model, "workload": args.workload, "samples_asked": args.samples, "max_new": args.max_new,
              "prompt_len": args.prompt_len, "other_len": list(args.other_len), "seed": args.seed,
              "device": str(model.device), "model_rows": args.rows, "paths": {}, "distinct_completions": {},
              "skipped": {}, "failed": {}, "torch_version": torch.__version__}
    if model.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(model.device)
    if args.workload == "stream":
        result.update(burst=args.burst, running=args.running, batch_tokens=args.batch_tokens)
    if "detattn" in paths and args.workload == "stream":
        try:  # every path gets the workload that fits the daemon's Forward limit
            with detattn_client(url, args) as c:
                args.batch_tokens = min(args.batch_tokens, c.hello().max_tokens_per_request)
        except Exception as e:  # the detattn path reports it
            print(f"detattn: hello failed: {e}", file=sys.stderr)
        result["batch_tokens"] = args.batch_tokens
    t_start = time.perf_counter()
    for i, name in enumerate(paths):
        limit = args.time_limit
        if args.time_budget:
            reserve = 2 * args.check_seconds + 30 if name == "detattn" else 0
            left = args.time_budget - (time.perf_counter() - t_start)
            share = max(5.0, (left - reserve) / (len(paths) - i))
            limit = min(limit, share) if limit else share
        try:
            if name == "detattn":
                r = run_detattn(args, cfg, model, prompt, daemon, url, limit)
            else:
                try:
                    attn = torch_backend(name, cfg, args)
                except RuntimeError as e:
                    print(f"{name}: skipped: {e}", file=sys.stderr)
                    result["skipped"][name] = str(e)
                    continue
                r = run_path(name, model, attn, cfg, prompt, args, limit)
                r["attention"] = dict(attn.info, decode_batches={str(k): v for k, v in
                                                                 sorted(attn.decode_batches.items())})
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as e:  # one path failing must not lose the others' results
            traceback.print_exc()
            if name == "detattn" and daemon is not None:
                print("detattnd's log, last lines:\n" + daemon.log[-3000:], file=sys.stderr)
            result["failed"][name] = f"{type(e).__name__}: {e}"
            result["skipped"][name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            continue
        result["paths"][name] = r
        result["distinct_completions"][name] = r["distinct_completions"]
        if args.json:  # what is done so far, should a later path hang or the run be killed
            Path(args.json).write_text(json.dumps(result, indent=1))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["samples"] = min((r["samples"] for r in result["paths"].values()), default=0)
    result["seconds"] = time.perf_counter() - t_start
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
    d = result["paths"].get("detattn")
    ok = ("detattn" not in result["failed"]) and (d is None or (d["distinct_completions"] == 1 and all(
        d.get(k, True) for k in ("two_processes_equal", "restart_equal"))))
    return 0 if ok else 1


if __name__ == "__main__":
    # A SIGTERM (a timeout) unwinds: the daemon started here is stopped, the JSON so far kept.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
