"""The torch module, model, engine and experiment: prefill, chunked prefill and decode give
the same bits through detattn; fork and rollback; the safetensors loader; a short
reproducibility run with exactly one completion for detattn."""

import json

import math

import pytest
import torch

import detattn
from detattn import safetensors
from detattn.engine import Engine, Request, generate
from detattn.model import CONFIGS, Transformer
from detattn.repro import main as repro_main
from detattn.torch import (Attention, DetattnAttention, Segment, SequenceTable, TorchAttention,
                           varlen_reference)

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


@pytest.mark.parametrize("path", ["detattn", "torch"])
def test_fork_for_parallel_sampling_and_rollback(url, model, path):
    prompt = list(range(1, 21))
    with detattn.Client(url) as c:
        att = DetattnAttention(c) if path == "detattn" else TorchAttention(CFG.n_layers, CFG.n_heads,
                                                                           CFG.n_kv_heads, CFG.head_dim)
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
        assert len(eng.table) == 0 and c.stats().sequences == 0


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


def rows(g, n, heads):
    return torch.randn(n, heads, CFG.head_dim, generator=g)


def test_drop_in_module_over_a_sequence_table(url):
    """The nn.Module with a SequenceTable: positions come from the table, every layer call
    of a step is one Forward, and a request's rows are the same bits alone, chunked, inside
    other requests' steps, after a fork and after a rollback."""
    g = torch.Generator().manual_seed(13)
    q, k, v = rows(g, 30, 4), rows(g, 30, 2), rows(g, 30, 2)
    oq, ok, ov = rows(g, 50, 4), rows(g, 50, 2), rows(g, 50, 2)
    layers = [Attention(0), Attention(1)]
    with detattn.Client(url) as c:
        att = DetattnAttention(c)
        t = SequenceTable(att)
        t.open("alone")
        b = t.batch([("alone", 30)])
        alone = [m(q, k, v, b) for m in layers]
        t.commit(b)
        assert t.length("alone") == 30 and att.calls == 2
        # "x" prefills in chunks of 7 while "o" prefills and decodes beside it.
        t.open("x")
        t.open("o")
        got, x_at, o_at = [[], []], 0, 0
        while x_at < 30:
            n = min(7, 30 - x_at)
            m_o = min(9 if o_at < 20 else 1, 50 - o_at)
            b = t.batch([("o", m_o), ("x", n)])
            assert b.positions().tolist() == list(range(o_at, o_at + m_o)) + list(range(x_at, x_at + n))
            Q = torch.cat([oq[o_at:o_at + m_o], q[x_at:x_at + n]])
            K = torch.cat([ok[o_at:o_at + m_o], k[x_at:x_at + n]])
            V = torch.cat([ov[o_at:o_at + m_o], v[x_at:x_at + n]])
            for i, m in enumerate(layers):
                got[i].append(m(Q, K, V, b)[m_o:])
            t.commit(b)
            x_at, o_at = x_at + n, o_at + m_o
        for i in range(2):
            assert torch.equal(torch.cat(got[i]), alone[i])
        # Fork (a beam) and rollback (speculation) through the table.
        t.fork("x", "beam")
        nq, nk, nv = rows(g, 1, 4), rows(g, 1, 2), rows(g, 1, 2)
        b = t.batch([("x", 1), ("beam", 1)])
        o = layers[0](torch.cat([nq, nq]), torch.cat([nk, nk]), torch.cat([nv, nv]), b)
        layers[1](torch.cat([nq, nq]), torch.cat([nk, nk]), torch.cat([nv, nv]), b)
        t.commit(b)
        assert torch.equal(o[0], o[1]) and t.length("beam") == 31
        t.truncate("x", 30)
        b = t.batch([("x", 1)])
        again = layers[0](nq, nk, nv, b)
        assert torch.equal(again[0], o[0])
        with pytest.raises(KeyError):
            t.open("x")
        for rid in ("alone", "x", "o", "beam"):
            t.close(rid)
        assert len(t) == 0 and c.stats().sequences == 0


def test_varlen_packing_against_the_padded_path_and_detattn(url):
    """TorchAttention(kind="varlen") packs a mixed step (prefill chunks and decodes) with
    cumulative lengths and calls varlen_attn with a causal window and the kv heads as they
    are; checked here with a float64 stand-in for the CUDA kernel, for both signatures torch
    has had (is_causal in 2.10, window_size later)."""
    seen = []

    def new_api(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        seen.append(("window", window_size, k.shape[1], max_q, max_k))
        assert window_size == (-1, 0) and isinstance(window_size, tuple)
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    def old_api(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append(("causal", is_causal, k.shape[1], max_q, max_k))
        assert is_causal
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, 1 / math.sqrt(q.shape[-1]))

    g = torch.Generator().manual_seed(17)
    steps = [[(0, 11), (1, 5)], [(0, 1), (1, 9), (2, 3)], [(0, 1), (1, 1), (2, 1)]]
    data = [[(rows(g, n, 4), rows(g, n, 2), rows(g, n, 2)) for _, n in st] for st in steps]
    outs = {}
    with detattn.Client(url) as c:
        backends = {"detattn": DetattnAttention(c),
                    "padded": TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim),
                    "new": TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, kind="varlen",
                                          varlen_fn=new_api),
                    "old": TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, kind="varlen",
                                          varlen_fn=old_api)}
        for name, be in backends.items():
            t = SequenceTable(be)
            for r in range(3):
                t.open(r)
            res = []
            for st, d in zip(steps, data):
                b = t.batch(st)
                res.append(Attention(0)(*(torch.cat([x[i] for x in d]) for i in range(3)), b))
                t.commit(b)
            outs[name] = torch.cat(res)
            for r in range(3):
                t.close(r)
    assert {s[2] for s in seen} == {2}  # kv heads as they are (GQA)
    assert [s[3:] for s in seen if s[0] == "window"] == [(11, 11), (9, 14), (1, 15)]
    assert torch.equal(outs["new"], outs["old"])
    for name in ("new", "padded"):  # bf16 outputs: within a few units in the last place
        err = (outs[name] - outs["detattn"]).abs().max() / outs["detattn"].abs().max()
        assert err < 2e-2, (name, float(err))
    info = backends["new"].info
    assert info["kernel"] == "varlen_attn" and info["gqa"] == "native" and "window_size" in info["varlen_args"]
    if not torch.cuda.is_available():  # the real kernel: CUDA (and torch >= 2.10) only
        with pytest.raises(RuntimeError):
            TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, kind="varlen")


def test_flash_and_cudnn_kinds_decode_in_equal_length_groups(url):
    """kind="flash"/"cudnn": the decode rows (one new token) of a step go to the one-backend
    SDPA call in groups of equal KV length, [G, Hq, 1, d] over [G, Hkv, L, d] (GQA heads as
    they are, no mask); prefill chunks go apart (causal). Checked with a float64 stand-in
    for the CUDA kernel against detattn; "varlen-decode" puts all decode rows in one
    varlen_attn call with max_seqlen_q 1."""
    seen, vseen = [], []

    def sdpa_fn(q, k, v, is_causal, scale, enable_gqa):
        seen.append((tuple(q.shape), tuple(k.shape), is_causal, enable_gqa))
        return detattn.torch.sdpa_reference(q, k, v, is_causal, scale)

    def varlen_fn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        vseen.append((len(cu_q) - 1, max_q, max_k))
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    g = torch.Generator().manual_seed(23)
    # Requests 0 and 1 prefill 9 tokens together, 2 prefills 5; then three decode steps
    # (0 and 1 share a length, 2 is shorter); request 3 joins with a prefill meanwhile.
    steps = [[(0, 9), (1, 9), (2, 5)], [(0, 1), (1, 1), (2, 1), (3, 6)], [(0, 1), (1, 1), (2, 1), (3, 1)],
             [(0, 1), (2, 1), (3, 1)]]
    data = [[(rows(g, n, 4), rows(g, n, 2), rows(g, n, 2)) for _, n in st] for st in steps]
    outs = {}
    with detattn.Client(url) as c:
        backends = {"detattn": DetattnAttention(c),
                    "flash": TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, kind="flash",
                                            sdpa_fn=sdpa_fn),
                    "varlen-decode": TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim,
                                                    kind="varlen-decode", varlen_fn=varlen_fn)}
        for name, be in backends.items():
            t = SequenceTable(be)
            for r in range(4):
                t.open(r)
            res = []
            for st, d in zip(steps, data):
                b = t.batch(st)
                res.append(Attention(0)(*(torch.cat([x[i] for x in d]) for i in range(3)), b))
                t.commit(b)
            outs[name] = torch.cat(res)
            for r in range(4):
                t.close(r)
    # Decode groups by KV length: {0, 1} at 10 keys, {2} at 6; {0, 1} at 11, {2, 3} at 7 (3 has
    # caught up: 6 prefilled + 1); {0} at 12, {2, 3} at 8.
    assert seen == [((2, 4, 1, 64), (2, 2, 10, 64), False, True), ((1, 4, 1, 64), (1, 2, 6, 64), False, True),
                    ((2, 4, 1, 64), (2, 2, 11, 64), False, True), ((2, 4, 1, 64), (2, 2, 7, 64), False, True),
                    ((1, 4, 1, 64), (1, 2, 12, 64), False, True), ((2, 4, 1, 64), (2, 2, 8, 64), False, True)]
    assert backends["flash"].decode_batches == {2: 4, 1: 2}
    assert vseen == [(3, 9, 9), (1, 6, 6), (3, 1, 10), (4, 1, 11), (3, 1, 12)]  # prefill and decode apart
    assert backends["varlen-decode"].decode_batches == {3: 2, 4: 1}
    for name in ("flash", "varlen-decode"):
        err = (outs[name] - outs["detattn"]).abs().max() / outs["detattn"].abs().max()
        assert err < 2e-2, (name, float(err))
    if not torch.cuda.is_available():  # the real kernels: CUDA only
        for kind in ("flash", "cudnn"):
            with pytest.raises(RuntimeError):
                TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, kind=kind)


def test_model_rows_in_fixed_chunks_are_batch_invariant(model):
    """linear() in fixed chunks of C rows: a row's bits do not depend on how many rows the
    step has (the GPU setting of the repro's model)."""
    from detattn.model import linear
    g = torch.Generator().manual_seed(31)
    x = torch.randn(300, CFG.dim, generator=g)
    w = model.layers[0].w1
    for rows in (1, 8, 64):
        alone = linear(x[:1], w, rows)
        for T in (2, 19, 64, 65, 300):
            assert torch.equal(linear(x[:T], w, rows)[0], alone[0]), (rows, T)


def test_engine_whole_chunks_wait_for_room(model):
    """whole_chunks: a prefill chunk that does not fit the step's remaining budget waits for
    the next step instead of being cut (a burst of equal prompts then prefills together)."""
    ta = TorchAttention(CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim)
    eng = Engine(model, ta, max_batch_tokens=100, prefill_chunk=64, whole_chunks=True)
    a = eng.add(Request(list(range(1, 61)), 2))
    b = eng.add(Request(list(range(2, 62)), 2))
    eng.step()
    assert (a.done_prompt, b.done_prompt) == (60, 0)  # b's 60 tokens did not fit the 40 left
    eng.step()
    assert b.done_prompt == 60 and eng.steps == 2
    big = eng.add(Request(list(range(1, 151)), 1, prefill_chunk=150))  # could never fit: cut
    while big.done_prompt < 150:
        eng.step()
    assert eng.decode_tokens >= 2


def test_repro_stream_workload_and_probe(url, tmp_path):
    """The stream workload (targets among bursts joining and leaving) through detattn and
    torch: the same batches for every path, one completion through detattn, also from two
    processes; the GPU-only paths are skipped with a reason. The probe: detattn's row is
    the same bits at every batch size."""
    out = tmp_path / "s.json"
    rc = repro_main(["--url", url, "--workload", "stream", "--samples", "5", "--max-new", "6", "--prompt-len", "40",
                     "--burst", "4", "--running", "8", "--paths", "detattn,torch,torch-flash", "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0
    d, t = r["paths"]["detattn"], r["paths"]["torch"]
    assert d["distinct_completions"] == 1 and d["distinct_logit_traces"] == 1 and d["two_processes_equal"] is True
    assert d["samples"] == t["samples"] == 5 and d["engine_steps"] == t["engine_steps"]
    assert d["engine_tokens"] == t["engine_tokens"] and len(d["completion_0"]) == 6
    assert "torch-flash" in r["skipped"] and d["attention"]["forwards"]["host"] > 0
    p = tmp_path / "p.json"
    assert repro_main(["--probe", "--url", url, "--prompt-len", "40", "--probe-batches", "1,2,3,6",
                       "--json", str(p)]) == 0
    pr = json.loads(p.read_text())
    det = [x for x in pr["rows"].values() if x["kernel"] == "detattn"]
    assert len(det) == 2 and all(x["differs_at"] == [] for x in det)
    assert [x["context"] for x in det] == [40, 41]
    assert any(x["kernel"].startswith("model matmul, one row") and x["differs_at"] == [] for x in pr["rows"].values())


def test_probe_varlen_kernel_packs_rows():
    """The probe's varlen_attn call: one query row per sequence, each over its own keys
    (equal or mixed lengths), kv heads as they are; checked with the float64 stand-in."""
    from detattn.probe import _mixed_lengths, _varlen_kernel

    def new_api(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                enable_gqa=False):
        assert window_size == (-1, 0) and enable_gqa and max_q == 1 and k.shape[1] == 2
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, 1 / math.sqrt(q.shape[-1]))

    g = torch.Generator().manual_seed(41)
    q, k, v = torch.randn(5, 4, 1, 64, generator=g), torch.randn(5, 2, 45, 64, generator=g), \
        torch.randn(5, 2, 45, 64, generator=g)
    for lens in ([45] * 5, _mixed_lengths(5, 30)):
        out = _varlen_kernel(new_api, None if lens[1] == 45 else lambda B: _mixed_lengths(B, 30))(q, k, v)
        assert max(lens) <= 45 and min(lens) >= 15
        for b in range(5):
            want = detattn.torch.sdpa_reference(q[b:b + 1], k[b:b + 1, :, :lens[b]], v[b:b + 1, :, :lens[b]], False,
                                                1 / 8)
            assert torch.allclose(out[b], want[0], atol=1e-5)
    assert _mixed_lengths(4, 30)[0] == 30 and _mixed_lengths(4, 30) == _mixed_lengths(4, 30)
