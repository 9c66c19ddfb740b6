"""The detattn client: a Python face of libdetattn (plugin/include/detattn.h).

Tensors are torch tensors or numpy arrays, row-major, in the daemon's dtype:
  q: [n_tokens, n_q_heads, head_dim], k and v: [n_tokens, n_kv_heads, head_dim]
  (or the same rows flattened to 2-D: [n_tokens, heads * head_dim]),
  o (returned): [n_tokens, n_q_heads, head_dim], lse (optional): [n_tokens, n_q_heads] float32.
numpy has no bfloat16: a bf16 daemon takes and returns numpy ``uint16`` arrays of the raw
bits (``to_bf16`` / ``from_bf16`` convert float32); fp16 uses ``float16``; float32 and
float64 inputs are rounded to the daemon's dtype (round to nearest even). torch tensors
may have any float dtype and device: they are rounded to the daemon's dtype, and outputs
come back as the daemon's dtype on q's device. CUDA tensors on the GPU of a CUDA daemon
that offers the cuda plane stay there: the daemon reads q/k/v and writes o/lse in device
memory (detattn_forward_cuda, ordered by torch's current stream); other CUDA tensors travel
through host memory. Every way gives the same bits.

numpy and torch are both optional: ``import detattn`` needs neither, ``forward`` takes
whichever the caller has.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence as Seq

from . import _lib
from ._lib import lib
from .errors import Cancelled, DetattnError, FailedPrecondition, InvalidArgument, check, error

try:  # optional
    import numpy as np
except ImportError:  # pragma: no cover - exercised by a test that hides numpy
    np = None

try:  # optional
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

#: The planes ``Client(data_plane=...)`` accepts (detattn_data_plane).
DATA_PLANES = ("auto", "copy", "shm", "cuda")


def _need_numpy(what: str):
    if np is None:
        raise ImportError(f"{what} needs numpy (Debian: python3-numpy)")
    return np


def to_bf16(x) -> "np.ndarray":
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN kept NaN."""
    _need_numpy("to_bf16")
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def from_bf16(x) -> "np.ndarray":
    """bfloat16 bits (uint16) -> float32."""
    _need_numpy("from_bf16")
    return (np.ascontiguousarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class ModelInfo:
    """The attention the daemon serves (detattn_model)."""
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # "bf16" or "fp16"
    scale: float
    softcap: float
    window: int
    page_tokens: int


@dataclass(frozen=True)
class ServerInfo:
    """What Hello returns (detattn_server_info): versions, the model, the numerics and
    their fingerprint, limits, the data planes offered."""
    server_version: str
    protocol_version: int
    model: ModelInfo
    backend: str
    arch: str
    kernel_version: int
    split_tokens: int
    tile_tokens: int
    fingerprint: int
    max_message_bytes: int
    max_tokens_per_request: int
    kv_capacity_tokens: int
    kv_pages: int
    data_planes: tuple


@dataclass(frozen=True)
class Stats:
    """The daemon's counters (detattn_stats). A client sees its own sequences and pages
    unless the daemon lets it see more (--stats-uids)."""
    uptime_ms: int
    requests: int
    errors: int
    forwards: int
    forward_tokens: int
    batches: int
    batch_tokens_mean: float
    batch_tokens_p50: float
    batch_tokens_p99: float
    batch_tokens_max: float
    batch_requests_mean: float
    batch_requests_max: float
    queue_us_mean: float
    queue_us_p50: float
    queue_us_p99: float
    queue_us_max: float
    inrow_items: int
    partial_items: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_free: int
    sequences: int
    clients: int
    arenas: int
    arena_bytes: int


@dataclass
class SeqIO:
    """One sequence's part of a Forward (detattn_seq_io): ``n`` new tokens at positions
    [pos, pos + n), n = q.shape[0]. ``seq`` is a ``Sequence`` or a sequence id."""
    seq: Any
    pos: int
    q: Any
    k: Any
    v: Any


@dataclass
class Output:
    """One sequence's result: o like q, lse [n, n_q_heads] float32 when asked for."""
    o: Any
    lse: Optional[Any] = None


def _cuda_device(x: Any) -> "Optional[torch.device]":
    """The CUDA device of a torch tensor; None for anything else."""
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda:
        return x.device
    return None


def _device_arch(dev: "torch.device") -> str:
    """The architecture of a CUDA device as detattnd names it ("sm_90")."""
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}"


def _current_stream(dev: "torch.device") -> int:
    """The cudaStream_t torch queues work on now, on ``dev`` (what orders a cuda-plane call)."""
    return torch.cuda.current_stream(dev).cuda_stream


def _device_guard(dev: "torch.device"):
    """Makes ``dev`` current on this thread for the call (libdetattn needs a current context)."""
    return torch.cuda.device(dev)


def _check_shape(shape: tuple, n: Optional[int], heads: int, d: int, what: str) -> int:
    """Checks ``shape`` is [n, heads, d] or [n, heads * d]; returns n."""
    ok = len(shape) >= 1 and (n is None or shape[0] == n) and (shape[1:] == (heads, d) or shape[1:] == (heads * d,))
    if not ok:
        want = f"[{'n' if n is None else n}, {heads}, {d}]"
        raise InvalidArgument(3, f"{what} has shape {list(shape)}, expected {want}", "forward")
    return shape[0]


def _torch_dtype(dtype: str):
    return torch.bfloat16 if dtype == "bf16" else torch.float16


class _Host:
    """A tensor handed to C: a contiguous host buffer of the daemon's dtype, kept alive
    while C may read it."""

    def __init__(self, x: Any, dtype: str, what: str):
        self.device = None
        if torch is not None and isinstance(x, torch.Tensor):
            want = _torch_dtype(dtype)
            t = x.detach()
            if not (t.is_floating_point() or t.dtype == want):
                raise InvalidArgument(3, f"{what} is {t.dtype}; a {dtype} daemon takes floating-point tensors",
                                      "forward")
            self.device = t.device
            t = t.to(dtype=want).to("cpu").contiguous()  # round on the tensor's device, then copy
            self.keep, self.ptr, self.shape, self.kind = t, t.data_ptr(), tuple(t.shape), "torch"
            return
        if np is None:
            raise InvalidArgument(3, f"{what} is a {type(x).__name__}; without numpy only torch tensors are taken",
                                  "forward")
        a = np.asarray(x)
        if a.dtype in (np.float32, np.float64):
            a = to_bf16(a) if dtype == "bf16" else a.astype(np.float16)
        want = np.uint16 if dtype == "bf16" else np.float16
        if dtype == "bf16" and a.dtype == np.int16:
            a = a.view(np.uint16)
        if a.dtype != want:
            raise InvalidArgument(3, f"{what} is {a.dtype}; a {dtype} daemon takes "
                                  f"{'uint16 (bf16 bits), float32 or float64' if dtype == 'bf16' else 'float16, float32 or float64'}",
                                  "forward")
        a = np.ascontiguousarray(a)
        self.keep, self.ptr, self.shape, self.kind = a, a.ctypes.data, tuple(a.shape), "numpy"

    def check(self, n: Optional[int], heads: int, d: int, what: str) -> int:
        """Checks the shape is [n, heads, d] or [n, heads * d]; returns n."""
        return _check_shape(self.shape, n, heads, d, what)


class _Device:
    """A CUDA tensor handed to C by the cuda plane: the caller's tensor when it is already
    contiguous in the daemon's dtype, else a converted copy on the same device; kept alive
    while the daemon may read it."""

    def __init__(self, x: "torch.Tensor", dtype: str, what: str):
        want = _torch_dtype(dtype)
        t = x.detach()
        if not (t.is_floating_point() or t.dtype == want):
            raise InvalidArgument(3, f"{what} is {t.dtype}; a {dtype} daemon takes floating-point tensors", "forward")
        if t.dtype != want:
            t = t.to(dtype=want)
        t = t.contiguous()
        self.keep, self.ptr, self.shape, self.kind, self.device = t, t.data_ptr(), tuple(t.shape), "cuda", t.device

    def check(self, n: Optional[int], heads: int, d: int, what: str) -> int:
        return _check_shape(self.shape, n, heads, d, what)


def _writable(buf: Any, kind: str, device, dtype, numel: int) -> bool:
    """Whether C may write ``numel`` elements of ``dtype`` straight into ``buf``."""
    if kind in ("torch", "cuda"):
        return (torch is not None and isinstance(buf, torch.Tensor) and buf.dtype == dtype and buf.is_contiguous()
                and buf.numel() == numel and not buf.requires_grad
                and (buf.device == device if kind == "cuda" else buf.device.type == "cpu"))
    return (np is not None and isinstance(buf, np.ndarray) and buf.dtype == dtype and buf.flags.c_contiguous
            and buf.flags.writeable and buf.size == numel)


class _Out:
    """Where one sequence's o (and lse) land, and how they are returned. ``kind``: "numpy",
    "torch" (host buffers; moved to ``device`` when the inputs were on one) or "cuda" (on
    ``device``, written by the daemon's GPU). With ``out`` (the caller's ``Output``) the
    daemon writes into its buffers when they have the right type, place and layout;
    otherwise the result is copied into them."""

    def __init__(self, kind: str, device, n: int, hq: int, d: int, dtype: str, want_lse: bool,
                 out: Optional[Output] = None, what: str = "out"):
        self.kind, self.device, self.out = kind, device, out
        if kind in ("torch", "cuda"):
            odt, ldt = _torch_dtype(dtype), torch.float32
            where = device if kind == "cuda" else "cpu"
            new_o = lambda: torch.empty((n, hq, d), dtype=odt, device=where)  # noqa: E731
            new_l = lambda: torch.empty((n, hq), dtype=ldt, device=where)  # noqa: E731
            ptr = lambda t: t.data_ptr()  # noqa: E731
        else:
            odt, ldt = np.dtype(np.uint16 if dtype == "bf16" else np.float16), np.dtype(np.float32)
            new_o = lambda: np.empty((n, hq, d), dtype=odt)  # noqa: E731
            new_l = lambda: np.empty((n, hq), dtype=ldt)  # noqa: E731
            ptr = lambda a: a.ctypes.data  # noqa: E731
        want_lse = want_lse or (out is not None and out.lse is not None)
        self.o = self.lse = None
        if out is not None:
            for name, buf, numel in (("o", out.o, n * hq * d), ("lse", out.lse, n * hq)):
                if buf is None:
                    continue
                want = odt if name == "o" else ldt
                if _writable(buf, kind, device, want, numel):
                    setattr(self, name, buf)
                    continue
                family = torch is not None and isinstance(buf, torch.Tensor) if kind != "numpy" else (
                    np is not None and isinstance(buf, np.ndarray) and buf.dtype == want and buf.flags.writeable)
                if not family or _numel(buf) != numel:
                    raise InvalidArgument(3, f"{what}.{name} is not a {'torch tensor' if kind != 'numpy' else want} "
                                          f"buffer of {numel} elements", "forward")
        self.direct = (self.o is not None, self.lse is not None)
        if self.o is None:
            self.o = new_o()
        if want_lse and self.lse is None:
            self.lse = new_l()
        self.o_ptr = ptr(self.o)
        self.lse_ptr = ptr(self.lse) if self.lse is not None else None

    def finish(self) -> Output:
        o, lse = self.o, self.lse
        if self.kind == "torch" and self.device is not None and self.device.type != "cpu":
            o = o.to(self.device)
            lse = lse.to(self.device) if lse is not None else None
        if self.out is None:
            return Output(o, lse)
        res = Output(self.out.o if self.out.o is not None else o, self.out.lse if self.out.lse is not None else lse)
        for dst, src, direct in ((self.out.o, o, self.direct[0]), (self.out.lse, lse, self.direct[1])):
            if dst is not None and not direct:
                _copy_into(dst, src)
        return res


def _numel(x: Any) -> int:
    n = getattr(x, "numel", None)
    return int(n()) if callable(n) else int(getattr(x, "size", -1))


def _copy_into(dst: Any, src: Any) -> None:
    """Copies a result into the caller's buffer (checked by ``_Out``: the same family and
    number of elements; torch converts dtype and device)."""
    if torch is not None and isinstance(dst, torch.Tensor):
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))
    else:
        np.copyto(dst, src.reshape(dst.shape))


class ForwardCall:
    """A Forward in flight (from ``Client.forward_async``, over detattn_forward_start /
    detattn_call_wait). ``result()`` waits for it (once; later calls return the same
    outputs or raise the same error); ``await call`` waits in a thread of the event loop's
    executor. A call dropped without waiting, and every call still in flight when its client
    is closed, is waited for then (libdetattn frees a call only in its wait)."""

    def __init__(self, client: "Client", call: ctypes.c_void_p, outs: list, keep: list, items: Seq[SeqIO],
                 device=None):
        self._client = client
        self._call = call
        self._device = device  # the cuda plane's device (its context is made current to wait)
        self._outs = outs
        self._keep = keep
        self._items = items
        self._lock = threading.Lock()
        self._result: Optional[List[Output]] = None
        self._error: Optional[DetattnError] = None

    def _finish(self) -> None:
        with self._lock:
            if self._call is None:
                return
            try:
                if self._device is not None:
                    with _device_guard(self._device):
                        rc = lib.detattn_call_wait(self._call)
                else:
                    rc = lib.detattn_call_wait(self._call)
                if rc != 0:
                    self._error = error(rc, "forward")
                else:
                    self._result = [o.finish() for o in self._outs]
                    self._client._advance(self._items)
            finally:
                self._call = None
                self._keep = self._items = None
                self._client._leave()

    def done(self) -> bool:
        """True once the call has been waited for (not whether the reply has arrived)."""
        return self._call is None

    def result(self) -> List[Output]:
        """Waits for the call; one ``Output`` per item, or raises its ``DetattnError``."""
        self._finish()
        if self._error is not None:
            raise self._error
        return self._result

    def __await__(self):
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.result).__await__()

    def __del__(self):
        try:
            self._finish()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Sequence:
    """A sequence open on the daemon; it belongs to its client's connection (the daemon
    closes it when the connection closes). A context manager: closed on exit. ``length``
    counts the tokens forwarded through this object (the daemon keeps one length per layer;
    each Forward's ``pos`` must equal that layer's length)."""

    def __init__(self, client: "Client", seq_id: int, length: int = 0):
        self.client = client
        self.id = seq_id
        self.length = length
        self.closed = False

    def fork(self) -> "Sequence":
        """A new sequence sharing this one's tokens (copy-on-write pages): detattn_seq_fork."""
        out = ctypes.c_uint64()
        with self.client._use() as c:
            check(lib.detattn_seq_fork(c, self.id, ctypes.byref(out)), "seq_fork")
        return Sequence(self.client, out.value, self.length)

    def truncate(self, length: int) -> None:
        """Every layer's length becomes min(its length, length): speculative rollback
        (detattn_seq_truncate)."""
        with self.client._use() as c:
            check(lib.detattn_seq_truncate(c, self.id, length), "seq_truncate")
        self.length = min(self.length, length)

    def close(self) -> None:
        """detattn_seq_close; a no-op once closed or once the client is closed."""
        if self.closed:
            return
        if not self.client.closed:
            with self.client._use() as c:
                check(lib.detattn_seq_close(c, self.id), "seq_close")
        self.closed = True

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        except DetattnError:
            if exc[0] is None:
                raise

    def __repr__(self) -> str:
        return f"Sequence(id={self.id:#x}, length={self.length})"


class Client:
    """A connection to detattnd (``ipc://PATH``, ``tcp://127.0.0.1:PORT``,
    ``tls+tcp://HOST:PORT``): detattn_connect_ex. Safe to use from many threads; a context
    manager (closed on exit).

    ``timeout_ms``: per-call timeout (<= 0 waits forever). ``data_plane``: how tensors
    travel (every plane gives the same bits):

    * "auto": CUDA tensors on the daemon's GPU by the cuda plane when the daemon offers it
      (detattn_forward_cuda: the daemon reads and writes them in place, no host copy);
      everything else by shared memory when the daemon offers it (ipc://), else copy.
    * "copy", "shm": that plane for every tensor (CUDA tensors through host memory).
    * "cuda": as "auto", but a daemon without the cuda plane (a CPU daemon, tcp://) fails
      every call with ``FailedPrecondition``; host tensors travel by shm.

    ``cuda_device``: the index (in this process) of the daemon's GPU, when the process sees
    several of the daemon's architecture (default: any device of that architecture; the
    daemon's Hello names its architecture, not its device). ``arena_bytes``: the
    shared-memory arena's size. ``tls_*``: PEM files for a ``tls+tcp://`` daemon (its CA;
    this client's certificate and key for mutual TLS; the name its certificate must carry).

    Connecting does not wait for the daemon: the first call does (up to its timeout) and
    raises ``Unavailable`` if none answers."""

    def __init__(self, url: str, timeout_ms: int = 60000, data_plane: str = "auto",
                 arena_bytes: int = 256 << 20, tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None,
                 cuda_device: Optional[int] = None):
        self._c = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._pending: "weakref.WeakSet[ForwardCall]" = weakref.WeakSet()
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane {data_plane!r} is not one of {DATA_PLANES}")
        if data_plane == "cuda" and _lib.cuda_api() is None:
            raise FailedPrecondition(9, f"this libdetattn ({_lib.path}) has no CUDA data plane "
                                     "(detattn_forward_cuda); use a newer one, or data_plane auto, shm or copy",
                                     "connect")
        opts = _lib.ConnectOpts()
        lib.detattn_connect_opts_init(ctypes.byref(opts))
        opts.data_plane = _lib.PLANE_NAMES[data_plane]
        opts.arena_bytes = arena_bytes
        opts.timeout_ms = timeout_ms
        enc = lambda x: x.encode() if x else None  # noqa: E731
        opts.tls_ca, opts.tls_cert, opts.tls_key = enc(tls_ca), enc(tls_cert), enc(tls_key)
        opts.tls_server_name = enc(tls_server_name)
        c = ctypes.c_void_p()
        check(lib.detattn_connect_ex(ctypes.byref(c), url.encode(), ctypes.byref(opts)), "connect")
        self._c = c
        self.url = url
        self.requested_plane = data_plane
        self.cuda_device = cuda_device
        #: Forwards made so far by the way their tensors went: "cuda" (detattn_forward_cuda)
        #: or "host" (detattn_forward: copy or shm, as ``data_plane`` says).
        self.forwards = {"cuda": 0, "host": 0}
        self._info: Optional[ServerInfo] = None
        self._cuda_ok: dict = {}

    # ---- lifetime ----
    @contextmanager
    def _use(self) -> Iterator[ctypes.c_void_p]:
        """The C handle for one call; close() waits until no call uses it."""
        c = self._enter()
        try:
            yield c
        finally:
            self._leave()

    def _enter(self) -> ctypes.c_void_p:
        with self._lock:
            if not self._c:
                raise Cancelled(1, "the client is closed", "client")
            self._active += 1
            return self._c

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._idle.notify_all()

    @property
    def closed(self) -> bool:
        return not self._c

    def close(self) -> None:
        """Closes the connection (detattn_close); the daemon closes every sequence it
        opened. New calls raise ``Cancelled``; calls in flight are waited for first (async
        ones keep their results), so no call touches a freed client."""
        with self._lock:
            c, self._c = self._c, None
        if not c:
            return
        for call in list(self._pending):
            call._finish()
        with self._lock:
            while self._active:
                self._idle.wait()
        lib.detattn_close(c)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def set_timeout(self, ms: int) -> None:
        """Per-call timeout in milliseconds for later calls (<= 0 waits forever)."""
        with self._use() as c:
            lib.detattn_set_timeout(c, ms)

    # ---- information ----
    def hello(self) -> ServerInfo:
        """detattn_hello: the daemon's model, numerics and limits (pinned by libdetattn at
        the first Hello: a reconnected daemon with other ones fails calls). With
        ``data_plane="cuda"``, ``FailedPrecondition`` when the daemon offers no cuda plane."""
        raw = _lib.ServerInfo()
        with self._use() as c:
            check(lib.detattn_hello(c, ctypes.byref(raw)), "hello")
        m = raw.model
        planes = tuple(n for n, b in _lib.PLANE_NAMES.items() if b and raw.data_planes & (1 << b))
        info = ServerInfo(
            raw.server_version.decode(), raw.protocol_version,
            ModelInfo(m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim, "fp16" if m.dtype == _lib.FP16 else "bf16",
                      m.scale, m.softcap, m.window, m.page_tokens),
            raw.backend.decode(), raw.arch.decode(), raw.kernel_version, raw.split_tokens, raw.tile_tokens,
            raw.fingerprint, raw.max_message_bytes, raw.max_tokens_per_request, raw.kv_capacity_tokens,
            raw.kv_pages, planes)
        if self.requested_plane == "cuda" and "cuda" not in planes:
            # What libdetattn says when it checks this itself; a library that does not yet
            # check gets the same answer here.
            raise FailedPrecondition(9, f"the daemon at {self.url} offers no cuda plane ({info.backend} backend, "
                                     f"planes {', '.join(planes)}): data_plane cuda needs a CUDA daemon on ipc:// "
                                     "on this host", "hello")
        self._info = info
        self._cuda_ok = {}
        return info

    @property
    def info(self) -> ServerInfo:
        """The last Hello (one is made if none was)."""
        return self._info or self.hello()

    @property
    def data_plane(self) -> str:
        """The plane calls use now (detattn_data_plane_get; after the first Hello)."""
        with self._use() as c:
            p = lib.detattn_data_plane_get(c)
        return {v: k for k, v in _lib.PLANE_NAMES.items()}[p]

    def cuda_plane_for(self, device: Any) -> bool:
        """Whether a Forward of CUDA tensors on ``device`` goes by the cuda plane (in place on
        the GPU, no host copy): this libdetattn has it, ``data_plane`` is "auto" or "cuda",
        the daemon offers it, and ``device`` is the daemon's GPU (``cuda_device`` when given,
        else a device of the daemon's architecture). Otherwise such tensors go through host
        memory, with the same bits."""
        if torch is None or device is None:
            return False
        dev = torch.device(device)
        if dev.type != "cuda" or self.requested_plane not in ("auto", "cuda") or _lib.cuda_api() is None:
            return False
        info = self.info
        if "cuda" not in info.data_planes:
            return False
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        ok = self._cuda_ok.get(index)
        if ok is None:
            if self.cuda_device is not None:
                ok = index == self.cuda_device
            else:
                ok = _device_arch(torch.device("cuda", index)) == info.arch
            self._cuda_ok[index] = ok
        return ok

    def stats(self) -> Stats:
        """detattn_stats_get."""
        s = _lib.Stats()
        with self._use() as c:
            check(lib.detattn_stats_get(c, ctypes.byref(s)), "stats")
        return Stats(**{name: getattr(s, name) for name, _ in _lib.Stats._fields_})

    # ---- sequences ----
    def seq_open(self) -> Sequence:
        """detattn_seq_open: a new empty sequence (a context manager)."""
        out = ctypes.c_uint64()
        with self._use() as c:
            check(lib.detattn_seq_open(c, ctypes.byref(out)), "seq_open")
        return Sequence(self, out.value)

    # ---- forward ----
    def _cuda_target(self, items: Seq[SeqIO]):
        """The device whose tensors go by the cuda plane, or None (the host path): every q,
        k and v must be a CUDA tensor of one device the cuda plane serves."""
        devs = {_cuda_device(x) for it in items for x in (it.q, it.k, it.v)}
        if len(devs) != 1:
            return None
        (dev,) = devs
        return dev if dev is not None and self.cuda_plane_for(dev) else None

    def _prepare(self, items: Seq[SeqIO], want_lse: bool, out: Optional[Seq[Output]]):
        if not items:
            raise InvalidArgument(3, "no sequences", "forward")
        if out is not None and len(out) != len(items):
            raise InvalidArgument(3, f"{len(out)} outputs for {len(items)} sequences", "forward")
        m = self.info.model
        dev = self._cuda_target(items)
        tensor = (lambda x, what: _Device(x, m.dtype, what)) if dev is not None else (
            lambda x, what: _Host(x, m.dtype, what))
        ios = (_lib.SeqIO * len(items))()
        keep, outs = [], []
        for i, it in enumerate(items):
            tq = tensor(it.q, f"items[{i}].q")
            n = tq.check(None, m.n_q_heads, m.head_dim, f"items[{i}].q")
            tk = tensor(it.k, f"items[{i}].k")
            tk.check(n, m.n_kv_heads, m.head_dim, f"items[{i}].k")
            tv = tensor(it.v, f"items[{i}].v")
            tv.check(n, m.n_kv_heads, m.head_dim, f"items[{i}].v")
            o = _Out(tq.kind, tq.device, n, m.n_q_heads, m.head_dim, m.dtype, want_lse,
                     out[i] if out is not None else None, f"out[{i}]")
            keep += [tq, tk, tv]
            outs.append(o)
            seq_id = it.seq.id if isinstance(it.seq, Sequence) else int(it.seq)
            ios[i] = _lib.SeqIO(seq_id, int(it.pos), n, tq.ptr, tk.ptr, tv.ptr, o.o_ptr, o.lse_ptr)
        keep += outs
        return dev, ios, keep, outs

    @staticmethod
    def _advance(items: Seq[SeqIO]) -> None:
        for it in items:
            if isinstance(it.seq, Sequence):
                it.seq.length = max(it.seq.length, int(it.pos) + int(it.q.shape[0]))

    def forward(self, layer: int, items: Seq[SeqIO], want_lse: bool = False,
                out: Optional[Seq[Output]] = None) -> List[Output]:
        """One Forward for ``layer`` over all ``items`` (detattn_forward, or
        detattn_forward_cuda for CUDA tensors the cuda plane serves: ordered after the work
        queued on torch's current stream, and work queued there afterwards sees the outputs):
        appends each item's k, v at [pos, pos + n) and returns its causal attention, one
        ``Output(o, lse)`` per item. Atomic: on error nothing is appended to any of them.

        ``out``: one ``Output`` per item whose ``o`` (and ``lse``) receive the results, in
        place when they are contiguous buffers of the daemon's dtype (float32 for lse) where
        the result is made (the GPU for the cuda plane, else host memory), else by a copy."""
        dev, ios, keep, outs = self._prepare(items, want_lse, out)
        with self._use() as c:
            if dev is None:
                rc = lib.detattn_forward(c, layer, ios, len(items))
            else:
                with _device_guard(dev):
                    rc = _lib.cuda_api().forward(c, layer, ios, len(items), _current_stream(dev))
            check(rc, "forward")
        self.forwards["host" if dev is None else "cuda"] += 1
        self._advance(items)
        res = [o.finish() for o in outs]
        del keep
        return res

    def forward_async(self, layer: int, items: Seq[SeqIO], want_lse: bool = False,
                      out: Optional[Seq[Output]] = None) -> ForwardCall:
        """Starts a Forward (detattn_forward_start or detattn_forward_cuda_start) and returns
        at once; ``.result()`` (or ``await``) gives the outputs. The call keeps its inputs
        and outputs alive until it is waited for (host inputs are copied before this
        returns; the cuda plane reads the caller's device tensors later, in place). Any
        number of calls may be in flight."""
        dev, ios, keep, outs = self._prepare(items, want_lse, out)
        call = ctypes.c_void_p()
        c = self._enter()
        try:
            if dev is None:
                rc = lib.detattn_forward_start(c, layer, ios, len(items), ctypes.byref(call))
            else:
                with _device_guard(dev):
                    rc = _lib.cuda_api().forward_start(c, layer, ios, len(items), _current_stream(dev),
                                                       ctypes.byref(call))
            check(rc, "forward")
        except BaseException:
            self._leave()
            raise
        self.forwards["host" if dev is None else "cuda"] += 1
        fc = ForwardCall(self, call, outs, keep + [ios], list(items), dev)
        self._pending.add(fc)
        return fc

    async def aforward(self, layer: int, items: Seq[SeqIO], want_lse: bool = False,
                       out: Optional[Seq[Output]] = None) -> List[Output]:
        """``await client.aforward(...)``: forward_async awaited."""
        return await self.forward_async(layer, items, want_lse, out)
