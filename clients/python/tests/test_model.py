"""The torch module, model, engine and experiment: prefill, chunked prefill and decode give
the same bits through detattn; fork and rollback; the safetensors loader; a short
reproducibility run with exactly one completion for detattn."""

import json

import numpy as np
import pytest
import torch

import detattn
from detattn import safetensors
from detattn.engine import Engine, Request, generate
from detattn.model import CONFIGS, Transformer
from detattn.repro import main as repro_main
from detattn.torch import DetattnAttention, Segment, TorchAttention

CFG = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def model():
    return Transformer.random(CFG, 1)


def test_attention_module_chunking_does_not_change_a_bit(url):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(40, 4, 64, generator=g)
    k = torch.randn(40, 2, 64, generator=g)
    v = torch.randn(40, 2, 64, generator=g)
    with detattn.Client(url) as c:
        att = DetattnAttention(c)
        a = att.new_seq()
        whole = att.attend(0, q, k, v, [Segment(a, 0, 0, 40)])
        b = att.new_seq()
        parts = []
        for lo, hi in [(0, 13), (13, 14), (14, 39), (39, 40)]:
            parts.append(att.attend(0, q[lo:hi], k[lo:hi], v[lo:hi], [Segment(b, lo, 0, hi - lo)]))
        assert torch.equal(whole, torch.cat(parts))
        # Inside a batch with another sequence: the same rows.
        c2 = att.new_seq()
        other = torch.randn(9, 4, 64, generator=g)
        ok = torch.randn(9, 2, 64, generator=g)
        mixed = att.attend(0, torch.cat([other, q]), torch.cat([ok, k]), torch.cat([ok, v]),
                           [Segment(c2, 0, 0, 9), Segment(att.new_seq(), 0, 9, 40)])
        assert torch.equal(mixed[9:], whole)


def test_generation_is_the_same_alone_chunked_and_batched(url, model):
    prompt = torch.randint(0, CFG.vocab, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with detattn.Client(url) as c:
        att = DetattnAttention(c)
        alone = generate(model, att, prompt, 12)
        chunked = generate(model, att, prompt, 12, prefill_chunk=5)
        eng = Engine(model, att, prefill_chunk=16)
        others = [Request(torch.randint(0, CFG.vocab, (n,)).tolist(), 9) for n in (7, 33, 18)]
        target = Request(prompt, 12, prefill_chunk=3)
        eng.run(others + [target])
        assert alone == chunked == target.out
        assert att.calls > 0
    # The torch in-process path computes the same model (within its own numerics).
    ta = TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim)
    assert len(generate(model, ta, prompt, 12)) == 12


def test_fork_for_parallel_sampling_and_rollback(url, model):
    prompt = list(range(1, 21))
    with detattn.Client(url) as c:
        att = DetattnAttention(c)
        eng = Engine(model, att)
        r = eng.add(Request(prompt, 8, temperature=0.8, seed=5))
        while len(r.out) < 3:
            eng.step()
        f = eng.fork(r)  # the sampler state too: the same tokens as r
        h = eng.fork(r, seed=99)  # parallel sampling: the same prefix, its own draws
        while not (r.finished and f.finished and h.finished):
            eng.step()
        assert r.out == f.out
        assert h.out[:3] == r.out[:3] and len(h.out) == 8
        # Speculative rollback: keep 4 tokens, regenerate greedily twice: the same.
        g = eng.add(Request(prompt, 10))
        while not g.finished:
            eng.step()
        first = list(g.out)
        eng.rollback(g, 4)
        g.max_new = 10
        while not g.finished:
            eng.step()
        assert g.out == first
        for x in list(eng.running):
            eng.release(x)
        assert c.stats().sequences == 0


def test_safetensors_round_trip_and_bad_files(tmp_path, model):
    p = tmp_path / "w.safetensors"
    model.save_safetensors(str(p))
    m2 = Transformer(CFG)
    m2.load_safetensors(str(p))
    for (n1, a), (n2, b) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    t = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.randn(4).to(torch.bfloat16)}
    safetensors.save(t, str(tmp_path / "t.safetensors"))
    back = safetensors.load(str(tmp_path / "t.safetensors"))
    assert torch.equal(back["a"], t["a"]) and torch.equal(back["b"], t["b"])
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-4])
    with pytest.raises(ValueError):
        safetensors.load(str(tmp_path / "cut.safetensors"))
    with pytest.raises(ValueError):
        Transformer(CONFIGS["tiny"]).load_safetensors(str(tmp_path / "t.safetensors"))


def test_repro_gives_one_completion_through_detattn(url, tmp_path):
    out = tmp_path / "r.json"
    rc = repro_main(["--url", url, "--model", "tiny", "--samples", "4", "--max-new", "10", "--json", str(out),
                     "--paths", "detattn,torch"])
    r = json.loads(out.read_text())
    assert rc == 0
    assert r["distinct_completions"]["detattn"] == 1
    assert r["paths"]["detattn"]["two_processes_equal"] is True
    assert r["paths"]["torch"]["samples"] == 4
