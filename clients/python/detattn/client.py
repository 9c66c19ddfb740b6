"""The detattn client: a Python face of libdetattn (plugin/include/detattn.h).

Tensors are torch tensors or numpy arrays, row-major, in the daemon's dtype:
  q: [n_tokens, n_q_heads, head_dim], k and v: [n_tokens, n_kv_heads, head_dim]
  (or the same rows flattened to 2-D: [n_tokens, heads * head_dim]),
  o (returned): [n_tokens, n_q_heads, head_dim], lse (optional): [n_tokens, n_q_heads] float32.
numpy has no bfloat16: a bf16 daemon takes and returns numpy ``uint16`` arrays of the raw
bits (``to_bf16`` / ``from_bf16`` convert float32); fp16 uses ``float16``; float32 and
float64 inputs are rounded to the daemon's dtype (round to nearest even). torch tensors
may have any float dtype and device: they are rounded to the daemon's dtype, and outputs
come back as the daemon's dtype on q's device.

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
from .errors import Cancelled, DetattnError, InvalidArgument, Unimplemented, check, error

try:  # optional
    import numpy as np
except ImportError:  # pragma: no cover - exercised by a test that hides numpy
    np = None

try:  # optional
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

#: The planes ``Client(data_plane=...)`` accepts today. "cuda" (CUDA tensors by IPC handle)
#: is named by the C API but not built in libdetattn yet.
DATA_PLANES = ("auto", "copy", "shm")


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


class _Host:
    """A tensor handed to C: a contiguous host buffer of the daemon's dtype, kept alive
    while C may read it."""

    def __init__(self, x: Any, dtype: str, what: str):
        self.device = None
        if torch is not None and isinstance(x, torch.Tensor):
            want = torch.bfloat16 if dtype == "bf16" else torch.float16
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
        s = self.shape
        ok = len(s) >= 1 and (n is None or s[0] == n) and (s[1:] == (heads, d) or s[1:] == (heads * d,))
        if not ok:
            want = f"[{'n' if n is None else n}, {heads}, {d}]"
            raise InvalidArgument(3, f"{what} has shape {list(s)}, expected {want}", "forward")
        return s[0]


class _Out:
    """Where one sequence's o (and lse) land, and how they are returned."""

    def __init__(self, kind: str, device, n: int, hq: int, d: int, dtype: str, want_lse: bool):
        shape = (n, hq, d)
        if kind == "torch":
            self.o = torch.empty(shape, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
            self.o_ptr = self.o.data_ptr()
            self.lse = torch.empty((n, hq), dtype=torch.float32) if want_lse else None
            self.lse_ptr = self.lse.data_ptr() if want_lse else None
        else:
            self.o = np.empty(shape, dtype=np.uint16 if dtype == "bf16" else np.float16)
            self.o_ptr = self.o.ctypes.data
            self.lse = np.empty((n, hq), dtype=np.float32) if want_lse else None
            self.lse_ptr = self.lse.ctypes.data if want_lse else None
        self.device = device

    def finish(self) -> Output:
        o, lse = self.o, self.lse
        if self.device is not None and self.device.type != "cpu":
            o = o.to(self.device)
            lse = lse.to(self.device) if lse is not None else None
        return Output(o, lse)


class ForwardCall:
    """A Forward in flight (from ``Client.forward_async``, over detattn_forward_start /
    detattn_call_wait). ``result()`` waits for it (once; later calls return the same
    outputs or raise the same error); ``await call`` waits in a thread of the event loop's
    executor. A call dropped without waiting, and every call still in flight when its client
    is closed, is waited for then (libdetattn frees a call only in its wait)."""

    def __init__(self, client: "Client", call: ctypes.c_void_p, outs: list, keep: list, items: Seq[SeqIO]):
        self._client = client
        self._call = call
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
    travel, chosen inside libdetattn: "auto" (shared memory when the daemon offers it on an
    ipc:// socket, else copy), "copy" or "shm"; every plane gives the same bits.
    ``arena_bytes``: the shared-memory arena's size. ``tls_*``: PEM files for a
    ``tls+tcp://`` daemon (its CA; this client's certificate and key for mutual TLS; the
    name its certificate must carry).

    Connecting does not wait for the daemon: the first call does (up to its timeout) and
    raises ``Unavailable`` if none answers."""

    def __init__(self, url: str, timeout_ms: int = 60000, data_plane: str = "auto",
                 arena_bytes: int = 256 << 20, tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None):
        self._c = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._pending: "weakref.WeakSet[ForwardCall]" = weakref.WeakSet()
        if data_plane == "cuda":
            raise Unimplemented(12, "libdetattn has no CUDA data plane yet: CUDA tensors travel through host memory "
                                "(data_plane auto, shm or copy)", "connect")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane {data_plane!r} is not one of {DATA_PLANES}")
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
        self._info: Optional[ServerInfo] = None

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
        the first Hello: a reconnected daemon with other ones fails calls)."""
        raw = _lib.ServerInfo()
        with self._use() as c:
            check(lib.detattn_hello(c, ctypes.byref(raw)), "hello")
        m = raw.model
        planes = tuple(n for n, b in _lib.PLANE_NAMES.items() if b and raw.data_planes & (1 << b))
        self._info = ServerInfo(
            raw.server_version.decode(), raw.protocol_version,
            ModelInfo(m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim, "fp16" if m.dtype == _lib.FP16 else "bf16",
                      m.scale, m.softcap, m.window, m.page_tokens),
            raw.backend.decode(), raw.arch.decode(), raw.kernel_version, raw.split_tokens, raw.tile_tokens,
            raw.fingerprint, raw.max_message_bytes, raw.max_tokens_per_request, raw.kv_capacity_tokens,
            raw.kv_pages, planes)
        return self._info

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
    def _prepare(self, items: Seq[SeqIO], want_lse: bool):
        if not items:
            raise InvalidArgument(3, "no sequences", "forward")
        m = self.info.model
        ios = (_lib.SeqIO * len(items))()
        keep, outs = [], []
        for i, it in enumerate(items):
            tq = _Host(it.q, m.dtype, f"items[{i}].q")
            n = tq.check(None, m.n_q_heads, m.head_dim, f"items[{i}].q")
            tk = _Host(it.k, m.dtype, f"items[{i}].k")
            tk.check(n, m.n_kv_heads, m.head_dim, f"items[{i}].k")
            tv = _Host(it.v, m.dtype, f"items[{i}].v")
            tv.check(n, m.n_kv_heads, m.head_dim, f"items[{i}].v")
            out = _Out(tq.kind, tq.device, n, m.n_q_heads, m.head_dim, m.dtype, want_lse)
            keep += [tq, tk, tv]
            outs.append(out)
            seq_id = it.seq.id if isinstance(it.seq, Sequence) else int(it.seq)
            ios[i] = _lib.SeqIO(seq_id, int(it.pos), n, tq.ptr, tk.ptr, tv.ptr, out.o_ptr, out.lse_ptr)
        return ios, keep, outs

    @staticmethod
    def _advance(items: Seq[SeqIO]) -> None:
        for it in items:
            if isinstance(it.seq, Sequence):
                it.seq.length = max(it.seq.length, int(it.pos) + int(it.q.shape[0]))

    def forward(self, layer: int, items: Seq[SeqIO], want_lse: bool = False) -> List[Output]:
        """One Forward for ``layer`` over all ``items`` (detattn_forward): appends each
        item's k, v at [pos, pos + n) and returns its causal attention, one ``Output(o, lse)``
        per item. Atomic: on error nothing is appended to any of them."""
        ios, keep, outs = self._prepare(items, want_lse)
        with self._use() as c:
            check(lib.detattn_forward(c, layer, ios, len(items)), "forward")
        self._advance(items)
        del keep
        return [o.finish() for o in outs]

    def forward_async(self, layer: int, items: Seq[SeqIO], want_lse: bool = False) -> ForwardCall:
        """Starts a Forward (detattn_forward_start) and returns at once; ``.result()`` (or
        ``await``) gives the outputs. The inputs are copied before this returns; any number
        of calls may be in flight."""
        ios, keep, outs = self._prepare(items, want_lse)
        call = ctypes.c_void_p()
        c = self._enter()
        try:
            check(lib.detattn_forward_start(c, layer, ios, len(items), ctypes.byref(call)), "forward")
        except BaseException:
            self._leave()
            raise
        fc = ForwardCall(self, call, outs, keep + [ios], list(items))
        self._pending.add(fc)
        return fc

    async def aforward(self, layer: int, items: Seq[SeqIO], want_lse: bool = False) -> List[Output]:
        """``await client.aforward(...)``: forward_async awaited."""
        return await self.forward_async(layer, items, want_lse)
