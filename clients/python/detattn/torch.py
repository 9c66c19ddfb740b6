"""Attention for Llama-style decoders (GQA, causal; RoPE applied by the caller), batched the
way a serving engine batches: one step carries prefill chunks and decode tokens of many
requests, packed as ``[tokens, heads, head_dim]`` rows.

* ``Attention`` (an ``nn.Module``): the drop-in attention core of one decoder layer,
  ``o = attn(q, k, v, batch)``. It holds only its layer index; the step's ``Batch`` says
  which rows belong to which sequence at which positions and which backend runs them.
* ``SequenceTable``: each request's sequence and length by request id (open, fork,
  truncate, close), and the ``Batch`` of a step (``batch``), advanced after it (``commit``).
* Backends, interchangeable behind ``AttentionBackend``:
  - ``DetattnAttention``: each layer call of a step is ONE Forward to detattnd carrying
    every sequence of the batch. The daemon keeps the KV cache; outputs are bit-identical
    whatever else is batched, however prefill is chunked.
    On a GPU with a daemon that offers the cuda plane, the step's q/k/v/o live in
    per-layer device buffers and the daemon reads and writes them in place (no host copy).
  - ``TorchAttention``: the usual in-process way, a KV cache in torch tensors and torch's
    own kernels, in one of these ``kind``s:
    ``padded``: one padded, masked call per layer for the batch (torch SDPA when present,
    else matmul-softmax);
    ``varlen``: the step's rows packed with cumulative lengths, one
    ``torch.nn.attention.varlen.varlen_attn`` call (flash attention; CUDA, torch >= 2.10);
    ``flash``, ``cudnn`` (serving-style decode through SDPA): the decode rows (one new
    token each) in groups of equal KV length, each group ONE unmasked SDPA call
    ``[G, Hq, 1, d]`` with only that backend enabled, whose split-KV heuristics see the
    group's size; prefill chunks through SDPA as torch picks (causal);
    ``varlen-decode``: prefill chunks in one ``varlen_attn`` call, the decode rows of the
    whole batch in another with ``max_seqlen_q`` 1 (how vLLM-style engines decode).
    Their bits may depend on the batch: the comparison in ``detattn.repro``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence as Seq, Tuple

import torch
from torch import nn

from . import client as _client
from .client import Client, Output, Sequence, SeqIO


@dataclass
class Segment:
    """Rows [start, start + n) of a step's packed tensors: sequence ``seq`` (a backend
    handle) at positions [pos, pos + n)."""
    seq: Any
    pos: int
    start: int
    n: int


@dataclass
class Batch:
    """One step's layout: its segments (in row order), the backend that runs attention and,
    when made by a ``SequenceTable``, the request id of each segment."""
    segments: List[Segment]
    backend: "AttentionBackend"
    rids: List[Hashable] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(s.n for s in self.segments)

    def positions(self) -> torch.Tensor:
        """The absolute position of every row ([n_tokens] int64), for RoPE."""
        pos = torch.empty(self.n_tokens, dtype=torch.long)
        for s in self.segments:
            pos[s.start:s.start + s.n] = torch.arange(s.pos, s.pos + s.n)
        return pos

    def last_rows(self) -> torch.Tensor:
        """The row of each segment's last token."""
        return torch.tensor([s.start + s.n - 1 for s in self.segments], dtype=torch.long)


class AttentionBackend:
    """What ``Attention`` runs on. ``attend`` gets q ``[T, Hq, d]``, k and v ``[T, Hkv, d]``
    of the step's new rows (RoPE applied), appends k and v to each segment's sequence at its
    positions, and returns causal attention o ``[T, Hq, d]`` (float32, values of the
    backend's dtype). Sequence handles come from ``new_seq``/``fork``."""

    name = "backend"

    def new_seq(self) -> Any:
        raise NotImplementedError

    def fork(self, seq: Any) -> Any:
        raise NotImplementedError

    def truncate(self, seq: Any, length: int) -> None:
        raise NotImplementedError

    def free(self, seq: Any) -> None:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               segments: List[Segment]) -> torch.Tensor:
        raise NotImplementedError


class _LayerBuffers:
    """One layer's device tensors for the cuda plane, grown as steps need: q, k, v and o
    in the daemon's dtype. Reused every step, so the daemon registers each once."""

    def __init__(self, rows: int, hq: int, hkv: int, d: int, dtype, device):
        cap = max(64, 1 << (rows - 1).bit_length())
        self.q = torch.empty(cap, hq, d, dtype=dtype, device=device)
        self.k = torch.empty(cap, hkv, d, dtype=dtype, device=device)
        self.v = torch.empty(cap, hkv, d, dtype=dtype, device=device)
        self.o = torch.empty(cap, hq, d, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.q.shape[0]


class DetattnAttention(AttentionBackend):
    """Attention through detattnd: one Forward per layer for the whole batch. Sequence
    handles are ``detattn.Sequence``s of ``client``.

    Where the step's tensors go: CUDA tensors on a GPU the client's cuda plane serves are
    rounded into per-layer device buffers and the daemon reads q/k/v and writes o there
    (``device_calls`` counts these calls); otherwise the step is rounded on its device,
    copied to the host once and the output copied back (``host_calls``). Both give the
    same bits. ``attend`` returns o as float32 on q's device."""

    name = "detattn"

    def __init__(self, client: Client):
        self.client = client
        m = client.info.model
        self.n_q_heads, self.n_kv_heads, self.head_dim = m.n_q_heads, m.n_kv_heads, m.head_dim
        self.dtype = torch.bfloat16 if m.dtype == "bf16" else torch.float16
        self.calls = 0
        self.device_calls = 0
        self.host_calls = 0
        self._buffers: Dict[int, _LayerBuffers] = {}

    def new_seq(self) -> Sequence:
        return self.client.seq_open()

    def fork(self, seq: Sequence) -> Sequence:
        return seq.fork()

    def truncate(self, seq: Sequence, length: int) -> None:
        seq.truncate(length)

    def free(self, seq: Sequence) -> None:
        seq.close()

    def buffers(self, layer: int, rows: int, device) -> _LayerBuffers:
        """Layer ``layer``'s device buffers, at least ``rows`` rows, on ``device``."""
        b = self._buffers.get(layer)
        if b is None or b.rows < rows or b.q.device != device:
            b = _LayerBuffers(rows, self.n_q_heads, self.n_kv_heads, self.head_dim, self.dtype, device)
            self._buffers[layer] = b
        return b

    def attend(self, layer, q, k, v, segments):
        self.calls += 1
        dev = _client._cuda_device(q)
        if dev is not None and self.client.cuda_plane_for(dev):
            self.device_calls += 1
            return self._attend_device(layer, q, k, v, segments)
        self.host_calls += 1
        # Round the whole step once on its device, copy it to the host once; segments are
        # row ranges of it (contiguous views).
        qh, kh, vh = (x.detach().to(self.dtype).to("cpu").contiguous() for x in (q, k, v))
        items = [SeqIO(s.seq, s.pos, qh[s.start:s.start + s.n], kh[s.start:s.start + s.n],
                       vh[s.start:s.start + s.n]) for s in segments]
        outs = self.client.forward(layer, items)
        o = torch.zeros(q.shape[0], self.n_q_heads, self.head_dim, dtype=self.dtype)
        for s, out in zip(segments, outs):
            o[s.start:s.start + s.n] = out.o.view(s.n, self.n_q_heads, self.head_dim)
        return o.to(q.device).float()

    def _attend_device(self, layer, q, k, v, segments):
        T = q.shape[0]
        b = self.buffers(layer, T, q.device)
        qb, kb, vb, ob = b.q[:T], b.k[:T], b.v[:T], b.o[:T]
        with torch.no_grad():
            qb.copy_(q.view(T, self.n_q_heads, self.head_dim))
            kb.copy_(k.view(T, self.n_kv_heads, self.head_dim))
            vb.copy_(v.view(T, self.n_kv_heads, self.head_dim))
            if sum(s.n for s in segments) != T:  # rows no segment covers stay 0, as on the host path
                ob.zero_()
        items = [SeqIO(s.seq, s.pos, qb[s.start:s.start + s.n], kb[s.start:s.start + s.n],
                       vb[s.start:s.start + s.n]) for s in segments]
        self.client.forward(layer, items, out=[Output(ob[s.start:s.start + s.n]) for s in segments])
        return ob.float()


class _TorchSeq:
    """A sequence's KV cache in TorchAttention: per layer, buffers [capacity, Hkv, d] of which
    the first ``length`` rows are used."""

    def __init__(self, n_layers: int):
        self.k: List[Optional[torch.Tensor]] = [None] * n_layers
        self.v: List[Optional[torch.Tensor]] = [None] * n_layers
        self.length = [0] * n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        L, n = self.length[layer], k.shape[0]
        if self.k[layer] is None or self.k[layer].shape[0] < L + n:
            cap = max(64, 2 * (L + n))
            nk, nv = k.new_empty((cap,) + tuple(k.shape[1:])), v.new_empty((cap,) + tuple(v.shape[1:]))
            if L:
                nk[:L], nv[:L] = self.k[layer][:L], self.v[layer][:L]
            self.k[layer], self.v[layer] = nk, nv
        self.k[layer][L:L + n] = k
        self.v[layer][L:L + n] = v
        self.length[layer] = L + n

    def keys(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        L = self.length[layer]
        return self.k[layer][:L], self.v[layer][:L]


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What ``varlen_attn`` computes with a causal window, in float64 one sequence at a time
    (bottom-right causal: query i of n sees the first L - n + i + 1 keys; GQA by head
    groups). For tests of the packing, not a torch kernel."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        n, L = q1 - q0, k1 - k0
        Q = q[q0:q1].double().transpose(0, 1)
        K = k[k0:k1].double().repeat_interleave(g, dim=1).transpose(0, 1)
        V = v[k0:k1].double().repeat_interleave(g, dim=1).transpose(0, 1)
        S = torch.matmul(Q, K.transpose(-1, -2)) * scale
        allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        S = S.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.matmul(torch.softmax(S, dim=-1), V).transpose(0, 1)
    return out.to(q.dtype)


def _torch_varlen() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10
    except ImportError:
        return None
    return varlen_attn


#: TorchAttention's kinds (see the module docstring).
KINDS = ("padded", "varlen", "flash", "cudnn", "varlen-decode")


def sdpa_reference(q, k, v, is_causal, scale):
    """What the ``flash``/``cudnn`` kinds' SDPA call computes, in float64: q ``[G, Hq, n, d]``,
    k and v ``[G, Hkv, L, d]`` (GQA by head groups); causal aligned bottom-right (query i of
    n sees the first L - n + i + 1 keys). For tests of the grouping, not a torch kernel."""
    G, hq, n, d = q.shape
    L, g = k.shape[2], hq // k.shape[1]
    K = k.double().repeat_interleave(g, dim=1)
    V = v.double().repeat_interleave(g, dim=1)
    S = torch.matmul(q.double(), K.transpose(-1, -2)) * scale
    if is_causal:
        allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        S = S.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(S, dim=-1), V).to(q.dtype)


def sdpa_backend(name: str) -> Optional[Callable]:
    """``fn(q, k, v, is_causal, scale, enable_gqa)``: torch SDPA with only backend ``name``
    (flash, cudnn, efficient, math) enabled, or None when this torch cannot restrict SDPA to
    one backend (``torch.nn.attention.sdpa_kernel``, torch >= 2.3)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    be = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
          "math": "MATH"}[name]
    if not hasattr(SDPBackend, be):
        return None
    backend = getattr(SDPBackend, be)

    def run(q, k, v, is_causal, scale, enable_gqa):
        kw = {"enable_gqa": True} if enable_gqa else {}
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, **kw)
    return run


class TorchAttention(AttentionBackend):
    """In-process attention: a KV cache per sequence and layer on ``device`` and torch's own
    attention kernels, as ``kind`` says (``KINDS``; the module docstring describes each).
    Inputs are rounded to ``dtype`` (as detattnd's are) and so are outputs; ``attend``
    returns float32 on q's device.

    ``compute_dtype``: what the ``padded`` kind computes in. ``varlen_fn``, ``sdpa_fn``:
    stand-ins for ``varlen_attn`` and for the one-backend SDPA call of the ``flash`` and
    ``cudnn`` kinds (``fn(q, k, v, is_causal, scale, enable_gqa)``), for tests on machines
    without the kernels. ``decode_batches`` counts the decode calls by their batch size
    (rows of one SDPA group, or of the decode varlen call): the batch size the kernels'
    split heuristics saw."""

    def __init__(self, n_layers: int, n_q_heads: int, n_kv_heads: int, head_dim: int, scale: float = 0.0,
                 dtype=torch.bfloat16, compute_dtype=torch.float32, device="cpu", kind: str = "padded",
                 varlen_fn: Optional[Callable] = None, sdpa_fn: Optional[Callable] = None):
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        self.n_layers, self.hq, self.hkv, self.d = n_layers, n_q_heads, n_kv_heads, head_dim
        self.scale = scale or 1.0 / math.sqrt(head_dim)
        self.dtype, self.compute_dtype, self.device, self.kind = dtype, compute_dtype, torch.device(device), kind
        self.name = "torch" if kind == "padded" else "torch-" + kind
        self.sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        self.info: Dict[str, Any] = {"kind": kind, "torch": torch.__version__, "device": str(self.device)}
        self.decode_batches: Dict[int, int] = {}
        # Calls ("all", "prefill", "decode") whose kernel refused kv heads as they are (GQA):
        # from the first refusal on, they get the kv heads repeated.
        self._gqa_off: set = set()
        if kind == "padded":
            self.info["kernel"] = "sdpa" if self.sdpa is not None else "matmul-softmax"
            self.info["compute_dtype"] = str(compute_dtype).replace("torch.", "")
        if kind in ("varlen", "varlen-decode"):
            self._init_varlen(varlen_fn)
            self.info["gqa"] = "native"
        if kind in ("flash", "cudnn"):
            fn = sdpa_fn or sdpa_backend(kind)
            if fn is None:
                raise RuntimeError(f"torch {torch.__version__} cannot restrict SDPA to one backend "
                                   "(torch.nn.attention.sdpa_kernel, torch >= 2.3)")
            if sdpa_fn is None and self.device.type != "cuda":
                raise RuntimeError(f"SDPA's {kind} backend is CUDA only")
            self._decode_fn = fn
            self.info["kernel"] = f"sdpa {kind} (decode), sdpa (prefill)"

    def _init_varlen(self, varlen_fn: Optional[Callable]) -> None:
        fn = varlen_fn or _torch_varlen()
        if fn is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)")
        if varlen_fn is None and self.device.type != "cuda":
            raise RuntimeError("varlen_attn is flash attention: CUDA only")
        self._varlen = fn
        params = inspect.signature(fn).parameters if _has_signature(fn) else {}
        self._varlen_kw: Dict[str, Any] = {}
        if "window_size" in params:
            self._varlen_kw["window_size"] = (-1, 0)  # a tuple: varlen_attn compares with (-1, 0)
        elif "is_causal" in params:
            self._varlen_kw["is_causal"] = True
        else:
            raise RuntimeError("varlen_attn takes neither window_size nor is_causal: unknown version")
        if "scale" in params:
            self._varlen_kw["scale"] = self.scale
        elif abs(self.scale - 1.0 / math.sqrt(self.d)) > 1e-12:
            raise RuntimeError("this varlen_attn has no scale argument and the scale is not 1/sqrt(head_dim)")
        if "enable_gqa" in params:
            self._varlen_kw["enable_gqa"] = True
        self.info["kernel"] = "varlen_attn" + (" (prefill and decode apart)" if self.kind == "varlen-decode" else "")
        self.info["varlen_args"] = sorted(self._varlen_kw)

    def new_seq(self):
        return _TorchSeq(self.n_layers)

    def fork(self, seq):
        f = _TorchSeq(self.n_layers)
        for l in range(self.n_layers):
            if seq.k[l] is not None:
                f.k[l], f.v[l] = seq.k[l].clone(), seq.v[l].clone()
            f.length[l] = seq.length[l]
        return f

    def truncate(self, seq, length):
        for l in range(self.n_layers):
            seq.length[l] = min(seq.length[l], length)

    def free(self, seq):
        seq.k = seq.v = None

    def attend(self, layer, q, k, v, segments):
        kd, vd = k.to(self.dtype).to(self.device), v.to(self.dtype).to(self.device)
        for s in segments:  # write before attend
            if s.pos != s.seq.length[layer]:
                raise ValueError(f"position {s.pos} is not the layer's length {s.seq.length[layer]}")
            s.seq.append(layer, kd[s.start:s.start + s.n], vd[s.start:s.start + s.n])
        if self.kind == "padded":
            return self._attend_padded(layer, q, segments)
        o = torch.zeros(q.shape[0], self.hq, self.d, dtype=torch.float32, device=q.device)
        if self.kind == "varlen":
            self._attend_varlen(layer, q, segments, o)
            return o
        prefill = [s for s in segments if s.n > 1]
        decode = [s for s in segments if s.n == 1]
        if self.kind == "varlen-decode":
            if decode:
                self.decode_batches[len(decode)] = self.decode_batches.get(len(decode), 0) + 1
            for part, what in ((prefill, "prefill"), (decode, "decode")):
                if part:
                    self._attend_varlen(layer, q, part, o, what)
            return o
        for part, is_decode in ((prefill, False), (decode, True)):
            for group in _equal_length_groups(part, layer):
                self._attend_group(layer, q, group, o, is_decode)
        return o

    def _sdpa_gqa(self, what, fn, q, k, v, is_causal):
        """One SDPA call of q [G, Hq, n, d] over k, v [G, Hkv, L, d]: kv heads as they are
        (enable_gqa) where the kernel takes them, else (from its first refusal on, for
        ``what``: "prefill" or "decode") repeated."""
        if what not in self._gqa_off:
            try:
                return fn(q, k, v, is_causal, self.scale, True)
            except (RuntimeError, TypeError, ValueError) as e:
                self._gqa_off.add(what)
                self.info[f"gqa_{what}"] = f"kv heads repeated ({str(e).splitlines()[0][:120]})"
        g = self.hq // self.hkv
        return fn(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), is_causal, self.scale, False)

    def _prefill_sdpa(self, q, k, v, is_causal, scale, enable_gqa):
        """Prefill chunks: torch SDPA as torch picks its backend (an explicit bottom-right
        mask where the chunk does not start at position 0), else matmul-softmax."""
        n, L = q.shape[2], k.shape[2]
        if self.sdpa is None:
            return sdpa_reference(q.float(), k.float(), v.float(), is_causal, scale).to(q.dtype)
        kw = {"enable_gqa": True} if enable_gqa else {}
        if is_causal and n != L:
            mask = torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
            return self.sdpa(q, k, v, attn_mask=mask, scale=scale, **kw)
        return self.sdpa(q, k, v, is_causal=is_causal, scale=scale, **kw)

    def _attend_group(self, layer, q, group, o, is_decode):
        dev = self.device
        # [G, H, len, d] contiguous, as a serving stack's SDPA call gets them.
        Q = torch.stack([q[s.start:s.start + s.n].transpose(0, 1) for s in group]).to(self.dtype).to(dev)
        kv = [s.seq.keys(layer) for s in group]
        K = torch.stack([x[0].transpose(0, 1) for x in kv])
        V = torch.stack([x[1].transpose(0, 1) for x in kv])
        if is_decode:
            self.decode_batches[len(group)] = self.decode_batches.get(len(group), 0) + 1
            O = self._sdpa_gqa("decode", self._decode_fn, Q, K, V, False)
        else:
            O = self._sdpa_gqa("prefill", self._prefill_sdpa, Q, K, V, True)
        O = O.transpose(1, 2).to(self.dtype).float().to(o.device)
        for i, s in enumerate(group):
            o[s.start:s.start + s.n] = O[i]

    def _attend_padded(self, layer, q, segments):
        B = len(segments)
        dev, cd = self.device, self.compute_dtype
        max_q = max(s.n for s in segments)
        max_kv = max(s.seq.length[layer] for s in segments)
        g = self.hq // self.hkv
        Q = torch.zeros(B, self.hq, max_q, self.d, dtype=cd, device=dev)
        K = torch.zeros(B, self.hq, max_kv, self.d, dtype=cd, device=dev)
        V = torch.zeros(B, self.hq, max_kv, self.d, dtype=cd, device=dev)
        mask = torch.zeros(B, 1, max_q, max_kv, dtype=torch.bool, device=dev)
        for b, s in enumerate(segments):
            kk, vv = s.seq.keys(layer)
            L = kk.shape[0]
            Q[b, :, :s.n] = q[s.start:s.start + s.n].to(self.dtype).to(dev, cd).transpose(0, 1)
            K[b, :, :L] = kk.to(cd).repeat_interleave(g, dim=1).transpose(0, 1)
            V[b, :, :L] = vv.to(cd).repeat_interleave(g, dim=1).transpose(0, 1)
            qpos = torch.arange(s.pos, s.pos + s.n, device=dev)
            mask[b, 0, :s.n, :L] = torch.arange(L, device=dev)[None, :] <= qpos[:, None]
        mask[:, :, :, 0] |= True  # padded query rows see one key: no NaN rows
        if self.sdpa is not None:
            # SDPA's default scale is 1/sqrt(d); scale= exists from torch 2.1 only.
            kw = {} if abs(self.scale - 1.0 / math.sqrt(self.d)) < 1e-12 else {"scale": self.scale}
            O = self.sdpa(Q, K, V, attn_mask=mask, **kw)
        else:
            S = torch.matmul(Q, K.transpose(-1, -2)) * self.scale
            S = S.masked_fill(~mask, float("-inf"))
            O = torch.matmul(torch.softmax(S, dim=-1), V)
        o = torch.zeros(q.shape[0], self.hq, self.d, dtype=torch.float32, device=q.device)
        for b, s in enumerate(segments):
            o[s.start:s.start + s.n] = O[b, :, :s.n].transpose(0, 1).to(self.dtype).float().to(q.device)
        return o

    def _attend_varlen(self, layer, q, segments, o, what="all"):
        """One varlen_attn call over ``segments``, written into o's rows (``what``: which
        calls a refusal of GQA heads applies to from then on)."""
        dev = self.device
        Q = torch.cat([q[s.start:s.start + s.n] for s in segments]).to(self.dtype).to(dev).contiguous()
        ks, vs = zip(*(s.seq.keys(layer) for s in segments))
        K, V = torch.cat(ks).contiguous(), torch.cat(vs).contiguous()
        nq = [s.n for s in segments]
        nk = [k.shape[0] for k in ks]
        cu_q = torch.tensor([0] + _cumsum(nq), dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + _cumsum(nk), dtype=torch.int32, device=dev)
        O = None
        if what not in self._gqa_off:
            try:
                O = self._varlen(Q, K, V, cu_q, cu_k, max(nq), max(nk), **self._varlen_kw)
            except (RuntimeError, ValueError) as e:  # a version that wants equal head counts
                self._gqa_off.add(what)
                self.info["gqa" if what == "all" else f"gqa_{what}"] = \
                    f"kv heads repeated ({str(e).splitlines()[0][:120]})"
        if O is None:
            g = self.hq // self.hkv
            O = self._varlen(Q, K.repeat_interleave(g, dim=1), V.repeat_interleave(g, dim=1), cu_q, cu_k, max(nq),
                             max(nk), **self._varlen_kw)
        O = O.to(self.dtype).float().to(o.device)
        off = 0
        for s in segments:
            o[s.start:s.start + s.n] = O[off:off + s.n]
            off += s.n


def _equal_length_groups(segments: List[Segment], layer: int) -> List[List[Segment]]:
    """Segments with the same new-token count and KV length, in order of first appearance:
    what one unmasked SDPA call can take."""
    groups: Dict[Tuple[int, int], List[Segment]] = {}
    for s in segments:
        groups.setdefault((s.n, s.seq.length[layer]), []).append(s)
    return list(groups.values())


def _has_signature(fn) -> bool:
    try:
        inspect.signature(fn)
        return True
    except (TypeError, ValueError):
        return False


def _cumsum(xs: Seq[int]) -> List[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


class SequenceTable:
    """Each request's sequence (a backend handle) and length, by request id: what a
    serving engine keeps beside its scheduler. ``batch`` lays out a step from
    ``(request id, new tokens)`` pairs at each request's current length; ``commit`` advances
    the lengths once every layer has run the step."""

    def __init__(self, backend: AttentionBackend):
        self.backend = backend
        self._seq: Dict[Hashable, Any] = {}
        self._len: Dict[Hashable, int] = {}

    def open(self, rid: Hashable) -> None:
        if rid in self._seq:
            raise KeyError(f"request {rid!r} is already open")
        self._seq[rid] = self.backend.new_seq()
        self._len[rid] = 0

    def fork(self, rid: Hashable, new_rid: Hashable) -> None:
        """``new_rid`` continues from ``rid``'s tokens (parallel sampling, beams)."""
        if new_rid in self._seq:
            raise KeyError(f"request {new_rid!r} is already open")
        self._seq[new_rid] = self.backend.fork(self._seq[rid])
        self._len[new_rid] = self._len[rid]

    def truncate(self, rid: Hashable, length: int) -> None:
        """Keeps the first ``length`` tokens (speculative rollback)."""
        self.backend.truncate(self._seq[rid], length)
        self._len[rid] = min(self._len[rid], length)

    def close(self, rid: Hashable) -> None:
        seq = self._seq.pop(rid)
        del self._len[rid]
        self.backend.free(seq)

    def length(self, rid: Hashable) -> int:
        return self._len[rid]

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._seq

    def __len__(self) -> int:
        return len(self._seq)

    def batch(self, counts: Seq[Tuple[Hashable, int]]) -> Batch:
        """The step's ``Batch``: request ``rid``'s ``n`` new rows follow the previous
        request's, at positions [length, length + n)."""
        segs, start = [], 0
        for rid, n in counts:
            if n <= 0:
                raise ValueError(f"request {rid!r}: {n} new tokens")
            segs.append(Segment(self._seq[rid], self._len[rid], start, n))
            start += n
        return Batch(segs, self.backend, [rid for rid, _ in counts])

    def commit(self, batch: Batch) -> None:
        for rid, s in zip(batch.rids, batch.segments):
            self._len[rid] = s.pos + s.n


class Attention(nn.Module):
    """The attention core of decoder layer ``layer``: causal GQA attention of the step's new
    rows over each sequence's cache, RoPE applied by the caller.

    ``forward(q, k, v, batch)``: q ``[T, Hq, d]``, k and v ``[T, Hkv, d]`` (rows packed as
    ``batch`` lays them out), returns o ``[T, Hq, d]`` float32. Every layer's call is one
    call of ``batch.backend`` for the whole batch: through detattnd, ONE Forward."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        return batch.backend.attend(self.layer, q, k, v, batch.segments)

    def extra_repr(self) -> str:
        return f"layer={self.layer}"
