"""The cuda plane's Python side on a machine without a GPU, against the real CPU daemon.

A CPU daemon offers no cuda plane: data_plane="cuda" fails with FailedPrecondition, "auto"
with host tensors is unchanged. The dispatch (which Forward goes by detattn_forward_cuda),
the tensors handed over (the caller's own when they are contiguous bf16, written in place
with ``out=``), the stream, the async form's keep-alive and DetattnAttention's per-layer
device buffers are tested with the C entry points replaced by stand-ins
(``fake_cuda``): CPU tensors play the CUDA tensors of device cuda:0, and the stand-in
runs the real host Forward on the same pointers, so the bits are the daemon's. The real
thing runs on the GPU machine: tests/test_gpu_cuda_plane.py."""

import ctypes
import contextlib
import dataclasses
import gc

import pytest
import torch

import detattn
from detattn import Output, SeqIO, _lib
from detattn import client as client_mod
from detattn.torch import DetattnAttention, Segment

STREAM = 0xC0FFEE


class FakeCuda:
    """Stand-ins for detattn_forward_cuda(_start) and the torch CUDA hooks; records calls.
    With ``defer`` the _start form only records the call and the work runs in
    detattn_call_wait, reading the tensors then (as the cuda plane does, later, on the GPU)."""

    def __init__(self, defer=False):
        self.calls = []
        self.defer = defer
        self.deferred = {}

    def forward(self, c, layer, ios, n, stream):
        self.calls.append(("forward", layer, n, stream, [(ios[i].q, ios[i].k, ios[i].v, ios[i].o) for i in range(n)]))
        return _lib.lib.detattn_forward(c, layer, ios, n)

    def forward_start(self, c, layer, ios, n, stream, out):
        self.calls.append(("start", layer, n, stream, [(ios[i].q, ios[i].k, ios[i].v, ios[i].o) for i in range(n)]))
        if not self.defer:
            return _lib.lib.detattn_forward_start(c, layer, ios, n, out)
        handle = 0x5EED0000 + len(self.calls)
        self.deferred[handle] = (c, layer, ios, n)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = handle
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """This process 'has' the cuda plane: torch CPU tensors are reported as on cuda:0, the
    daemon's Hello lists "cuda", libdetattn 'has' detattn_forward_cuda."""
    fake = FakeCuda()
    monkeypatch.setattr(_lib, "cuda_api", lambda: _lib.CudaApi(fake.forward, fake.forward_start))
    monkeypatch.setattr(client_mod, "_cuda_device",
                        lambda x: torch.device("cuda", 0) if isinstance(x, torch.Tensor) else None)
    monkeypatch.setattr(client_mod, "_device_arch", lambda dev: "x86_64")  # the CPU daemon's arch
    monkeypatch.setattr(client_mod, "_current_stream", lambda dev: STREAM)
    monkeypatch.setattr(client_mod, "_device_guard", lambda dev: contextlib.nullcontext())
    real_hello = client_mod.Client.hello

    def hello(self):
        asked, self.requested_plane = self.requested_plane, "auto"  # the real check would refuse
        try:
            info = real_hello(self)
        finally:
            self.requested_plane = asked
        self._info = dataclasses.replace(info, data_planes=info.data_planes + ("cuda",))
        return self._info
    monkeypatch.setattr(client_mod.Client, "hello", hello)
    real_wait = _lib.lib.detattn_call_wait

    def wait(call):
        h = call.value if isinstance(call, ctypes.c_void_p) else call
        if h in fake.deferred:
            c, layer, ios, n = fake.deferred.pop(h)
            return _lib.lib.detattn_forward(c, layer, ios, n)
        return real_wait(call)
    monkeypatch.setattr(_lib.lib, "detattn_call_wait", wait)
    return fake


def qkv(seed, n):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, 64, generator=g), torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g))


def bits(t):
    return t.contiguous().view(torch.int16).numpy().tobytes()


def test_cuda_plane_refused_by_a_cpu_daemon(url, monkeypatch):
    q, k, v = qkv(1, 3)
    # This libdetattn: whether or not it has the cuda plane, "cuda" fails clearly.
    with pytest.raises(detattn.FailedPrecondition) as e:
        with detattn.Client(url, data_plane="cuda") as c:
            c.hello()
    assert e.value.code == 9 and e.value.status == "FAILED_PRECONDITION" and "cuda" in e.value.message.lower()
    # A libdetattn with the plane against a daemon without it: every call that needs the
    # daemon's Hello fails (libdetattn says why, or this package where it does not check).
    monkeypatch.setattr(_lib, "cuda_api", lambda: _lib.CudaApi(None, None))
    with detattn.Client(url, data_plane="cuda") as c:
        with pytest.raises(detattn.FailedPrecondition) as e:
            c.hello()
        assert e.value.code == 9 and "cuda" in e.value.message.lower()  # libdetattn's words, or ours
        with c.seq_open() as s, pytest.raises(detattn.FailedPrecondition):
            c.forward(0, [SeqIO(s, 0, q, k, v)])
        assert s.length == 0
    # "auto" with host tensors: unchanged (shm on ipc), never the cuda entry point.
    with detattn.Client(url) as c, c.seq_open() as s:
        assert not c.cuda_plane_for("cpu") and not c.cuda_plane_for(None)
        (o,) = c.forward(0, [SeqIO(s, 0, q, k, v)])
        assert c.data_plane == "shm" and c.forwards == {"cuda": 0, "host": 1}
        assert o.o.dtype == torch.bfloat16 and o.o.device.type == "cpu"


def test_dispatch_rules(url, fake_cuda, monkeypatch):
    """Which Forwards go by the cuda entry point: all of q/k/v CUDA tensors of one device,
    the plane asked for (auto), offered, and the daemon's GPU."""
    q, k, v = qkv(2, 2)
    # ("cuda" dispatches as "auto" does; a libdetattn that checks the daemon itself refuses
    # it against this CPU daemon, so it is not among the cases.)
    cases = [("auto", {}, (q, k, v), "cuda"),
             ("shm", {}, (q, k, v), "host"), ("copy", {}, (q, k, v), "host"),
             ("auto", {}, (q, k.numpy(), v), "host"),            # host and device pointers never mix
             ("auto", {"cuda_device": 0}, (q, k, v), "cuda"),
             ("auto", {"cuda_device": 1}, (q, k, v), "host")]    # not the daemon's GPU
    for plane, kw, (a, b, cc), want in cases:
        with detattn.Client(url, data_plane=plane, **kw) as c, c.seq_open() as s:
            n_before = len(fake_cuda.calls)
            c.forward(0, [SeqIO(s, 0, a, b, cc)])
            assert c.forwards[want] == 1 and c.forwards["cuda" if want == "host" else "host"] == 0, (plane, kw, want)
            assert len(fake_cuda.calls) - n_before == (want == "cuda")
    monkeypatch.setattr(client_mod, "_device_arch", lambda dev: "sm_90")  # another architecture
    with detattn.Client(url) as c:
        assert not c.cuda_plane_for(torch.device("cuda", 0))
    monkeypatch.setattr(_lib, "cuda_api", lambda: None)  # a libdetattn without the plane
    with detattn.Client(url) as c:
        assert not c.cuda_plane_for(torch.device("cuda", 0))


def test_cuda_path_bits_pointers_stream_and_out(url, fake_cuda):
    """The same bits as the host path; bf16 contiguous inputs are handed over as they are
    (no copy), others converted on their device; outputs are new tensors on the inputs'
    device, or the caller's buffers written in place; the call is ordered on torch's
    current stream."""
    q, k, v = qkv(3, 9)
    with detattn.Client(url, data_plane="copy") as c, c.seq_open() as s:
        (ref,) = c.forward(1, [SeqIO(s, 0, q, k, v)], want_lse=True)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    with detattn.Client(url) as c, c.seq_open() as s, c.seq_open() as s2:
        (a,) = c.forward(1, [SeqIO(s, 0, qb, kb, vb)], want_lse=True)
        kind, layer, n, stream, ptrs = fake_cuda.calls[-1]
        assert (kind, layer, n, stream) == ("forward", 1, 1, STREAM)
        assert ptrs[0][:3] == (qb.data_ptr(), kb.data_ptr(), vb.data_ptr())  # no copy
        assert ptrs[0][3] == a.o.data_ptr()
        assert a.o.dtype == torch.bfloat16 and a.o.is_contiguous() and a.o.shape == (9, 4, 64)
        assert a.lse.dtype == torch.float32 and a.lse.shape == (9, 4)
        assert bits(a.o) == bits(ref.o) and torch.equal(a.lse, ref.lse)
        # float32 and flattened [n, heads * d] inputs, outputs into the caller's buffers.
        o_buf = torch.full((9, 4 * 64), float("nan"), dtype=torch.bfloat16)
        lse_buf = torch.zeros(9, 4)
        (b,) = c.forward(1, [SeqIO(s2, 0, q.reshape(9, -1), k, v)], out=[Output(o_buf, lse_buf)])
        assert fake_cuda.calls[-1][4][0][0] != q.data_ptr()       # converted to bf16 first
        assert fake_cuda.calls[-1][4][0][3] == o_buf.data_ptr()   # written in place
        assert b.o is o_buf and b.lse is lse_buf
        assert bits(o_buf) == bits(ref.o) and torch.equal(lse_buf, ref.lse)
        # A buffer the daemon cannot write directly (float32) is filled by a copy.
        with c.seq_open() as s3:
            o32 = torch.zeros(9, 4, 64)
            (x,) = c.forward(1, [SeqIO(s3, 0, q, k, v)], out=[Output(o32)])
            assert fake_cuda.calls[-1][4][0][3] != o32.data_ptr() and x.o is o32
            assert torch.equal(o32, ref.o.float())
        with c.seq_open() as s4, pytest.raises(detattn.InvalidArgument):
            c.forward(1, [SeqIO(s4, 0, q, k, v)], out=[Output(torch.zeros(8, 4, 64, dtype=torch.bfloat16))])


def test_async_cuda_call_keeps_its_tensors_until_it_completes(url, fake_cuda):
    """The cuda plane reads the inputs after _start returns: the call must hold the
    converted tensors (the caller's are float32 and dropped at once) until its wait."""
    fake_cuda.defer = True
    q, k, v = qkv(4, 33)
    with detattn.Client(url, data_plane="copy") as c, c.seq_open() as s:
        (ref,) = c.forward(0, [SeqIO(s, 0, q, k, v)])
    with detattn.Client(url) as c, c.seq_open() as s:
        call = c.forward_async(0, [SeqIO(s, 0, q.clone(), k.clone(), v.clone())])
        assert fake_cuda.calls[-1][0] == "start" and not call.done()
        gc.collect()
        junk = [torch.full((33, 4, 64), 7.0, dtype=torch.bfloat16) for _ in range(64)]  # would reuse freed memory
        (o,) = call.result()
        del junk
        assert bits(o.o) == bits(ref.o) and s.length == 33

        async def run():
            return await c.aforward(0, [SeqIO(s, 33, *qkv(5, 1))])
        import asyncio
        (o2,) = asyncio.run(run())
        assert o2.o.shape == (1, 4, 64) and s.length == 34 and c.forwards["cuda"] == 2


def test_detattn_attention_keeps_device_buffers(url, fake_cuda):
    """DetattnAttention on the cuda plane: the step's rows go into per-layer buffers that
    the daemon reads and writes (no host copy), reused while they are large enough; the
    bits equal the host path's."""
    q, k, v = qkv(6, 40)
    with detattn.Client(url, data_plane="copy") as c:
        host = DetattnAttention(c)
        a = host.new_seq()
        want = torch.cat([host.attend(0, q[lo:hi], k[lo:hi], v[lo:hi], [Segment(a, lo, 0, hi - lo)])
                          for lo, hi in [(0, 30), (30, 31), (31, 40)]])
        assert c.forwards == {"cuda": 0, "host": 3}
    with detattn.Client(url) as c:
        att = DetattnAttention(c)
        b = att.new_seq()
        other = att.new_seq()
        got, ptrs = [], set()
        for lo, hi in [(0, 30), (30, 31), (31, 40)]:
            oq, ok, ov = qkv(7 + lo, 2)
            o = att.attend(0, torch.cat([oq, q[lo:hi]]), torch.cat([ok, k[lo:hi]]), torch.cat([ov, v[lo:hi]]),
                           [Segment(other, other.length, 0, 2), Segment(b, lo, 2, hi - lo)])
            got.append(o[2:])
            ptrs.add(fake_cuda.calls[-1][4][1][3] - 2 * 4 * 64 * 2)  # o buffer's start (item 1 begins at row 2)
        assert att.device_calls == 3 and att.host_calls == 0 and c.forwards == {"cuda": 3, "host": 0}
        assert len(ptrs) == 1 and att.buffers(0, 32, torch.device("cpu")).o.data_ptr() in ptrs  # one buffer, reused
        out = torch.cat(got)
        assert out.dtype == torch.float32 and torch.equal(out, want)
