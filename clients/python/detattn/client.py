"""The detattn client: a Python face of libdetattn (plugin/include/detattn.h).

Tensors are numpy arrays or torch tensors, row-major, in the daemon's dtype:
  q: [n_tokens, n_q_heads, head_dim], k and v: [n_tokens, n_kv_heads, head_dim],
  o (returned): like q, lse (optional): [n_tokens, n_q_heads] float32.
numpy has no bfloat16: a bf16 daemon takes and returns numpy ``uint16`` arrays of the raw
bits (``to_bf16`` / ``from_bf16`` convert float32); fp16 uses ``float16``. float32 inputs
are rounded to the daemon's dtype. torch tensors may be any dtype and device: they are
converted to the daemon's dtype on the CPU and outputs come back on the input's device.
"""

from __future__ import annotations

import asyncio
import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence as Seq

import numpy as np

from . import _lib
from ._lib import lib
from .errors import Cancelled, DetattnError, InvalidArgument, check, error

try:  # optional
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN kept NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def from_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32."""
    return (np.ascontiguousarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class ModelInfo:
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
    """What Hello returns: versions, the model, the numerics and its fingerprint, limits."""
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
    """The daemon's counters (a client sees its own sequences and pages unless allowed more)."""
    uptime_ms: int
    requests: int
    errors: int
    forwards: int
    forward_tokens: int
    batches: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_free: int
    sequences: int
    clients: int
    arenas: int
    queue_us_p50: float
    queue_us_p99: float


@dataclass
class SeqIO:
    """One sequence's part of a Forward: n new tokens at positions [pos, pos + n)."""
    seq: int
    pos: int
    q: Any
    k: Any
    v: Any


@dataclass
class Output:
    o: Any
    lse: Optional[Any] = None


class _Tensor:
    """A tensor handed to C: a contiguous host buffer of the daemon's dtype, kept alive."""

    def __init__(self, x: Any, shape: tuple, dtype: str, what: str):
        self.torch_dtype = None
        self.device = None
        if torch is not None and isinstance(x, torch.Tensor):
            self.device = x.device
            want = torch.bfloat16 if dtype == "bf16" else torch.float16
            t = x.detach().to(device="cpu", dtype=want).contiguous()
            if tuple(t.shape) != shape and t.numel() == int(np.prod(shape)):
                t = t.reshape(shape)
            if tuple(t.shape) != shape:
                raise InvalidArgument(3, f"{what} has shape {tuple(x.shape)}, expected {shape}", "forward")
            self.keep = t
            self.ptr = t.data_ptr()
            self.kind = "torch"
            return
        a = np.asarray(x)
        if a.dtype == np.float32 or a.dtype == np.float64:
            a = to_bf16(a) if dtype == "bf16" else a.astype(np.float16)
        want = np.uint16 if dtype == "bf16" else np.float16
        if a.dtype != want and not (dtype == "bf16" and a.dtype == np.int16):
            raise InvalidArgument(3, f"{what} is {a.dtype}; a {dtype} daemon takes "
                               f"{'uint16 (bf16 bits) or float32' if dtype == 'bf16' else 'float16 or float32'}",
                               "forward")
        a = np.ascontiguousarray(a)
        if a.shape != shape and a.size == int(np.prod(shape)):
            a = a.reshape(shape)
        if a.shape != shape:
            raise InvalidArgument(3, f"{what} has shape {a.shape}, expected {shape}", "forward")
        self.keep = a
        self.ptr = a.ctypes.data
        self.kind = "numpy"


class ForwardCall:
    """A Forward in flight (from Client.forward_async). ``result()`` waits for it once."""

    def __init__(self, client: "Client", call: ctypes.c_void_p, outs: list, keep: list):
        self._client = client
        self._call = call
        self._outs = outs
        self._keep = keep
        self._result = None
        self._error = None

    def result(self) -> list:
        if self._call is not None:
            rc = lib.detattn_call_wait(self._call)
            self._call = None
            self._keep = None
            if rc != 0:
                self._error = error(rc, "forward")
            else:
                self._result = [o.finish() for o in self._outs]
        if self._error is not None:
            raise self._error
        return self._result

    def __await__(self):
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.result).__await__()


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
        if self.device is not None and str(self.device) != "cpu":
            o = o.to(self.device)
            lse = lse.to(self.device) if lse is not None else None
        return Output(o, lse)


class Sequence:
    """A sequence open on the daemon: belongs to its client's connection. A context
    manager: closed on exit. ``length`` counts the tokens this object has seen forwarded
    through it (the daemon keeps one length per layer; ``pos`` arguments must match)."""

    def __init__(self, client: "Client", seq_id: int, length: int = 0):
        self.client = client
        self.id = seq_id
        self.length = length
        self.closed = False

    def fork(self) -> "Sequence":
        """A new sequence sharing this one's tokens (copy-on-write pages)."""
        out = ctypes.c_uint64()
        check(lib.detattn_seq_fork(self.client._c, self.id, ctypes.byref(out)), "seq_fork")
        return Sequence(self.client, out.value, self.length)

    def truncate(self, length: int) -> None:
        """Every layer's length becomes min(its length, length): speculative rollback."""
        check(lib.detattn_seq_truncate(self.client._c, self.id, length), "seq_truncate")
        self.length = min(self.length, length)

    def close(self) -> None:
        if not self.closed and self.client._c:
            check(lib.detattn_seq_close(self.client._c, self.id), "seq_close")
        self.closed = True

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc) -> None:
        if not self.closed and self.client._c:
            try:
                self.close()
            except DetattnError:
                if exc[0] is None:
                    raise

    def __repr__(self) -> str:
        return f"Sequence(id={self.id:#x}, length={self.length})"


class Client:
    """A connection to detattnd (``ipc://PATH``, ``tcp://127.0.0.1:PORT``). Safe to use from
    many threads. ``data_plane``: "auto" (shared memory when the daemon offers it, else
    copy), "copy" or "shm"; every plane gives the same bits. ``tls_*``: PEM files for a
    ``tls+tcp://`` daemon (its CA; this client's certificate and key for mutual TLS)."""

    def __init__(self, url: str, timeout_ms: int = 60000, data_plane: str = "auto",
                 arena_bytes: int = 256 << 20, tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None):
        if data_plane not in _lib.PLANE_NAMES:
            raise ValueError(f"data_plane {data_plane!r} is not one of {sorted(_lib.PLANE_NAMES)}")
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
    def close(self) -> None:
        """Closes the connection; the daemon closes every sequence it opened."""
        if self._c:
            lib.detattn_close(self._c)
            self._c = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def _handle(self):
        if not self._c:
            raise Cancelled(1, "the client is closed", "client")
        return self._c

    # ---- information ----
    def hello(self) -> ServerInfo:
        raw = _lib.ServerInfo()
        check(lib.detattn_hello(self._handle(), ctypes.byref(raw)), "hello")
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
        return self._info or self.hello()

    @property
    def data_plane(self) -> str:
        """The plane calls use now (after the first Hello)."""
        p = lib.detattn_data_plane_get(self._handle())
        return {v: k for k, v in _lib.PLANE_NAMES.items()}[p]

    def stats(self) -> Stats:
        s = _lib.Stats()
        check(lib.detattn_stats_get(self._handle(), ctypes.byref(s)), "stats")
        return Stats(s.uptime_ms, s.requests, s.errors, s.forwards, s.forward_tokens, s.batches, s.kv_pages_total,
                     s.kv_pages_used, s.kv_pages_free, s.sequences, s.clients, s.arenas, s.queue_us_p50,
                     s.queue_us_p99)

    # ---- sequences ----
    def seq_open(self) -> Sequence:
        out = ctypes.c_uint64()
        check(lib.detattn_seq_open(self._handle(), ctypes.byref(out)), "seq_open")
        return Sequence(self, out.value)

    # ---- forward ----
    def _prepare(self, layer: int, items: Seq[SeqIO], want_lse: bool):
        if not items:
            raise InvalidArgument(3, "no sequences", "forward")
        m = self.info.model
        ios = (_lib.SeqIO * len(items))()
        keep, outs = [], []
        for i, it in enumerate(items):
            qa = it.q
            n = int(qa.shape[0])
            tq = _Tensor(it.q, (n, m.n_q_heads, m.head_dim), m.dtype, f"items[{i}].q")
            tk = _Tensor(it.k, (n, m.n_kv_heads, m.head_dim), m.dtype, f"items[{i}].k")
            tv = _Tensor(it.v, (n, m.n_kv_heads, m.head_dim), m.dtype, f"items[{i}].v")
            out = _Out(tq.kind, tq.device, n, m.n_q_heads, m.head_dim, m.dtype, want_lse)
            keep += [tq, tk, tv]
            outs.append(out)
            seq_id = it.seq.id if isinstance(it.seq, Sequence) else int(it.seq)
            ios[i] = _lib.SeqIO(seq_id, int(it.pos), n, tq.ptr, tk.ptr, tv.ptr, out.o_ptr, out.lse_ptr)
        return ios, keep, outs

    def _advance(self, items: Seq[SeqIO]) -> None:
        for it in items:
            if isinstance(it.seq, Sequence):
                it.seq.length = max(it.seq.length, int(it.pos) + int(it.q.shape[0]))

    def forward(self, layer: int, items: Seq[SeqIO], want_lse: bool = False) -> list:
        """One Forward for ``layer`` over all ``items`` (atomic: on error nothing is
        appended to any of them). Returns one ``Output(o, lse)`` per item."""
        ios, keep, outs = self._prepare(layer, items, want_lse)
        check(lib.detattn_forward(self._handle(), layer, ios, len(items)), "forward")
        self._advance(items)
        del keep
        return [o.finish() for o in outs]

    def forward_async(self, layer: int, items: Seq[SeqIO], want_lse: bool = False) -> ForwardCall:
        """Starts a Forward and returns at once; ``.result()`` (or ``await``) gives the
        outputs. Any number may be in flight."""
        ios, keep, outs = self._prepare(layer, items, want_lse)
        call = ctypes.c_void_p()
        check(lib.detattn_forward_start(self._handle(), layer, ios, len(items), ctypes.byref(call)), "forward")
        self._advance(items)
        return ForwardCall(self, call, outs, keep + [ios])
