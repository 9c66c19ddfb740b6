"""The client API against a real daemon: hello/stats, sequences, forward with numpy and
torch, async calls, every plane giving the same bits, and errors that carry the daemon's
status and message."""

import asyncio
import time

import numpy as np
import pytest
import torch

import detattn
from detattn import SeqIO


def ref_attention(q, k, v, pos0, scale):
    """float64 causal GQA attention of q [n,Hq,d] at positions pos0.. over k,v [L,Hkv,d]."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    o = np.zeros((n, hq, d))
    for t in range(n):
        p = pos0 + t
        for h in range(hq):
            s = (k[:p + 1, h // g] @ q[t, h]) * scale
            w = np.exp(s - s.max())
            o[t, h] = (w[:, None] * v[:p + 1, h // g]).sum(0) / w.sum()
    return o


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_hello_and_stats(url):
    with detattn.Client(url) as c:
        info = c.hello()
        assert info.model.n_q_heads == 4 and info.model.head_dim == 64 and info.model.dtype == "bf16"
        assert info.backend == "cpu" and info.fingerprint != 0
        assert "copy" in info.data_planes and "shm" in info.data_planes
        s = c.stats()
        assert s.kv_pages_total > 0 and s.kv_pages_used == 0


def test_forward_matches_float64_reference(url):
    rng = np.random.default_rng(7)
    with detattn.Client(url) as c, c.seq_open() as s:
        m = c.info.model
        q, k, v = rand(rng, 37, 4, 64), rand(rng, 37, 2, 64), rand(rng, 37, 2, 64)
        (out,) = c.forward(0, [SeqIO(s, 0, q, k, v)], want_lse=True)
        assert out.o.dtype == np.uint16 and out.o.shape == (37, 4, 64) and out.lse.shape == (37, 4)
        qb, kb, vb = (detattn.from_bf16(detattn.to_bf16(x)).astype(np.float64) for x in (q, k, v))
        ref = ref_attention(qb, kb, vb, 0, m.scale)
        got = detattn.from_bf16(out.o).astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2
        assert s.length == 37


def test_numpy_torch_prefill_chunked_and_decode_give_the_same_bits(url):
    rng = np.random.default_rng(11)
    q, k, v = rand(rng, 50, 4, 64), rand(rng, 50, 2, 64), rand(rng, 50, 2, 64)
    with detattn.Client(url) as c:
        with c.seq_open() as a:
            (whole,) = c.forward(0, [SeqIO(a, 0, q, k, v)])
        with c.seq_open() as b:
            parts = []
            for lo, hi in [(0, 7), (7, 8), (8, 40), (40, 41), (41, 50)]:
                (o,) = c.forward(0, [SeqIO(b, lo, torch.tensor(q[lo:hi]), torch.tensor(k[lo:hi]),
                                          torch.tensor(v[lo:hi]))])
                assert o.o.dtype == torch.bfloat16
                parts.append(o.o.view(torch.int16).numpy().view(np.uint16))
        assert np.array_equal(whole.o, np.concatenate(parts))


def test_every_plane_gives_the_same_bits(url):
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 20, 4, 64), rand(rng, 20, 2, 64), rand(rng, 20, 2, 64)
    outs = {}
    for plane in ("copy", "shm", "auto"):
        with detattn.Client(url, data_plane=plane) as c, c.seq_open() as s:
            c.hello()
            assert c.data_plane == ("shm" if plane == "auto" else plane)
            (o,) = c.forward(1, [SeqIO(s, 0, q, k, v)], want_lse=True)
            outs[plane] = (o.o.tobytes(), o.lse.tobytes())
    assert outs["copy"] == outs["shm"] == outs["auto"]


def test_async_and_many_sequences_in_one_forward(url):
    rng = np.random.default_rng(5)
    with detattn.Client(url) as c:
        seqs = [c.seq_open() for _ in range(3)]
        items = [SeqIO(s, 0, rand(rng, 5 + i, 4, 64), rand(rng, 5 + i, 2, 64), rand(rng, 5 + i, 2, 64))
                 for i, s in enumerate(seqs)]
        call = c.forward_async(0, items)
        outs = call.result()
        assert [o.o.shape[0] for o in outs] == [5, 6, 7]
        items2 = [SeqIO(s, s.length, rand(rng, 1, 4, 64), rand(rng, 1, 2, 64), rand(rng, 1, 2, 64)) for s in seqs]

        async def run():
            return await c.forward_async(0, items2)

        outs2 = asyncio.run(run())
        assert len(outs2) == 3 and all(o.o.shape == (1, 4, 64) for o in outs2)
        for s in seqs:
            s.close()


def test_fork_and_truncate(url):
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 12, 4, 64), rand(rng, 12, 2, 64), rand(rng, 12, 2, 64)
    with detattn.Client(url) as c:
        base = c.seq_open()
        c.forward(0, [SeqIO(base, 0, q[:10], k[:10], v[:10])])
        f = base.fork()
        assert f.length == 10
        (a,) = c.forward(0, [SeqIO(base, 10, q[10:], k[10:], v[10:])])
        (b,) = c.forward(0, [SeqIO(f, 10, q[10:], k[10:], v[10:])])
        assert np.array_equal(a.o, b.o)
        base.truncate(10)
        (again,) = c.forward(0, [SeqIO(base, 10, q[10:], k[10:], v[10:])])
        assert np.array_equal(a.o, again.o)
        base.close()
        f.close()


def test_errors_carry_status_code_and_message(url):
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 3, 4, 64), rand(rng, 3, 2, 64), rand(rng, 3, 2, 64)
    with detattn.Client(url) as c:
        with c.seq_open() as s:
            with pytest.raises(detattn.FailedPrecondition) as e:
                c.forward(0, [SeqIO(s, 5, q, k, v)])
            assert e.value.code == 9 and e.value.status == "FAILED_PRECONDITION"
            assert "expected 0, got 5" in e.value.message
            with pytest.raises(detattn.InvalidArgument):
                c.forward(0, [SeqIO(s, 0, q, k[:, :1], v)])
            with pytest.raises(detattn.InvalidArgument):
                c.forward(0, [SeqIO(s, 0, q.astype(np.int32), k, v)])
            with pytest.raises(detattn.InvalidArgument):
                c.forward(7, [SeqIO(s, 0, q, k, v)])
        with pytest.raises(detattn.NotFound) as e:
            c.forward(0, [SeqIO(12345, 0, q, k, v)])
        assert "not open on this connection" in e.value.message
        with pytest.raises(detattn.NotFound):
            c.forward(0, [SeqIO(s, 0, q, k, v)])  # closed
    with pytest.raises(detattn.Cancelled):
        c.stats()  # the client is closed
    with pytest.raises(ValueError):
        detattn.Client(url, data_plane="bogus")
    with pytest.raises(detattn.DetattnError):
        detattn.Client("bogus://x")


def test_no_daemon_is_unavailable(tmp_path):
    c = detattn.Client(f"ipc://{tmp_path}/nobody.sock", timeout_ms=300)
    with pytest.raises(detattn.Unavailable) as e:
        c.hello()
    assert e.value.code == 14
    c.close()


def test_status_names_and_classes_mirror_the_c_api():
    from detattn import _lib
    from detattn.errors import _BY_CODE
    for code in range(16):
        assert _lib.lib.detattn_status_name(code).decode() == _lib.STATUS_NAMES[code]
        if code:
            cls = _BY_CODE[code]
            e = detattn.errors.error(code, "x")
            assert type(e) is cls and e.code == code and e.status == _lib.STATUS_NAMES[code]
            assert issubclass(cls, detattn.DetattnError)
    assert _lib.lib.detattn_status_name(99).decode() == "UNKNOWN_STATUS"
    assert type(detattn.errors.error(99)) is detattn.DetattnError


def test_flat_rows_and_torch_dtypes(url):
    rng = np.random.default_rng(21)
    q, k, v = rand(rng, 6, 4, 64), rand(rng, 6, 2, 64), rand(rng, 6, 2, 64)
    with detattn.Client(url) as c:
        with c.seq_open() as a:
            (x,) = c.forward(0, [SeqIO(a, 0, q, k, v)])
        with c.seq_open() as b:  # [n, heads * d] rows and float64 torch tensors: the same bits
            (y,) = c.forward(0, [SeqIO(b, 0, torch.tensor(q.reshape(6, -1), dtype=torch.float64),
                                       torch.tensor(k.reshape(6, -1)), torch.tensor(v).to(torch.bfloat16))])
        assert np.array_equal(x.o, y.o.view(torch.int16).numpy().view(np.uint16))
        with c.seq_open() as s:
            with pytest.raises(detattn.InvalidArgument) as e:
                c.forward(0, [SeqIO(s, 0, torch.ones(6, 4, 64, dtype=torch.int32), k, v)])
            assert "floating-point" in e.value.message
            with pytest.raises(detattn.InvalidArgument) as e:
                c.forward(0, [SeqIO(s, 0, q, k[:5], v)])  # k has fewer rows than q
            assert "expected [6, 2, 64]" in e.value.message
            assert c.stats().forwards >= 2 and s.length == 0


def test_close_waits_for_calls_in_flight(url):
    rng = np.random.default_rng(8)
    c = detattn.Client(url)
    s = c.seq_open()
    call = c.forward_async(0, [SeqIO(s, 0, rand(rng, 9, 4, 64), rand(rng, 9, 2, 64), rand(rng, 9, 2, 64))])
    dropped = c.forward_async(1, [SeqIO(s, 0, rand(rng, 9, 4, 64), rand(rng, 9, 2, 64), rand(rng, 9, 2, 64))])
    del dropped  # never waited: waited for when collected
    c.close()  # waits for `call`; its result stays
    assert call.done()
    (o,) = call.result()
    assert o.o.shape == (9, 4, 64) and s.length == 9
    with pytest.raises(detattn.Cancelled):
        c.forward(0, [SeqIO(s, 9, rand(rng, 1, 4, 64), rand(rng, 1, 2, 64), rand(rng, 1, 2, 64))])
    s.close()  # a no-op: the daemon closed it with the connection
    with detattn.Client(url) as c2:  # the daemon frees a closed connection's sequences when
        deadline = time.monotonic() + 5  # it sees the pipe go, which c2's calls may overtake
        while c2.stats().sequences and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c2.stats().sequences == 0


def test_async_errors(url):
    rng = np.random.default_rng(2)
    with detattn.Client(url) as c, c.seq_open() as s:
        call = c.forward_async(0, [SeqIO(s, 3, rand(rng, 2, 4, 64), rand(rng, 2, 2, 64), rand(rng, 2, 2, 64))])
        for _ in range(2):  # the same error each time
            with pytest.raises(detattn.FailedPrecondition):
                call.result()
        assert s.length == 0


def test_import_without_numpy_or_torch(url, tmp_path):
    """numpy and torch are optional: a process where neither can be imported (Debian's
    torch itself needs numpy) still imports detattn, talks to the daemon, and gets a clear
    error for tensors it cannot take."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "bare.py"
    script.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'torch'):\n"
        "            raise ImportError(name + ' hidden by the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import detattn\n"
        "from detattn import client\n"
        "assert client.np is None and client.torch is None\n"
        f"with detattn.Client({url!r}) as c, c.seq_open() as s:\n"
        "    assert c.hello().model.n_q_heads == 4 and c.stats().sequences >= 1\n"
        "    try:\n"
        "        c.forward(0, [detattn.SeqIO(s, 0, [[0.0]], [[0.0]], [[0.0]])])\n"
        "    except detattn.InvalidArgument as e:\n"
        "        assert 'without numpy' in e.message, e.message\n"
        "    else:\n"
        "        raise AssertionError('a list was taken without numpy')\n"
        "    try:\n"
        "        detattn.to_bf16([1.0])\n"
        "    except ImportError as e:\n"
        "        assert 'numpy' in str(e)\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
