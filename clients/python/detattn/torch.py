"""Attention for Llama-style decoders (GQA, causal; RoPE applied by the caller) with two
interchangeable backends behind one interface:

* ``DetattnAttention``: every layer call of a step is ONE Forward to detattnd carrying
  every sequence of the batch (prefill chunks and decode tokens together). The daemon keeps
  the KV cache; outputs are bit-identical whatever else is batched.
* ``TorchAttention``: the usual in-process way, a KV cache in torch tensors and one padded,
  masked attention call per layer for the whole batch (torch SDPA when present, else
  matmul-softmax). Its bits depend on the batch: the comparison in ``detattn.repro``.

A step is described by ``Segment``s: which sequence, at which position, how many tokens, and
where its rows are in the packed ``[tokens, heads, head_dim]`` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List

import torch

from .client import Client, Sequence, SeqIO


@dataclass
class Segment:
    """Rows [start, start + n) of a step's packed tensors: sequence ``seq`` at positions
    [pos, pos + n)."""
    seq: Any
    pos: int
    start: int
    n: int


class AttentionBackend:
    """The interface the model and the engine use. ``attend`` gets q ``[T, Hq, d]``, k and
    v ``[T, Hkv, d]`` of the step's new tokens and returns o ``[T, Hq, d]`` (float32)."""

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


class DetattnAttention(AttentionBackend):
    """Attention through detattnd: one Forward per layer for the whole batch."""

    def __init__(self, client: Client):
        self.client = client
        m = client.info.model
        self.n_q_heads, self.n_kv_heads, self.head_dim = m.n_q_heads, m.n_kv_heads, m.head_dim
        self.calls = 0

    def new_seq(self) -> Sequence:
        return self.client.seq_open()

    def fork(self, seq: Sequence) -> Sequence:
        return seq.fork()

    def truncate(self, seq: Sequence, length: int) -> None:
        seq.truncate(length)

    def free(self, seq: Sequence) -> None:
        seq.close()

    def attend(self, layer, q, k, v, segments):
        items = [SeqIO(s.seq.id, s.pos, q[s.start:s.start + s.n], k[s.start:s.start + s.n],
                       v[s.start:s.start + s.n]) for s in segments]
        outs = self.client.forward(layer, items)
        self.calls += 1
        o = torch.empty(q.shape, dtype=torch.float32)
        for s, out in zip(segments, outs):
            o[s.start:s.start + s.n] = out.o.to(torch.float32)
        return o


class _TorchSeq:
    def __init__(self, n_layers: int):
        self.k: List[List[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.v: List[List[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.length = [0] * n_layers


class TorchAttention(AttentionBackend):
    """In-process attention: a KV cache per sequence and layer, and one padded, masked
    attention call per layer for the whole batch. Inputs are rounded to ``dtype`` (as
    detattnd's are), attention runs in ``compute_dtype`` on ``device``."""

    def __init__(self, n_layers: int, n_q_heads: int, n_kv_heads: int, head_dim: int, scale: float = 0.0,
                 dtype=torch.bfloat16, compute_dtype=torch.float32, device="cpu"):
        self.n_layers, self.hq, self.hkv, self.d = n_layers, n_q_heads, n_kv_heads, head_dim
        self.scale = scale or 1.0 / math.sqrt(head_dim)
        self.dtype, self.compute_dtype, self.device = dtype, compute_dtype, device
        self.sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)

    def new_seq(self):
        return _TorchSeq(self.n_layers)

    def fork(self, seq):
        f = _TorchSeq(self.n_layers)
        for l in range(self.n_layers):
            f.k[l] = list(seq.k[l])
            f.v[l] = list(seq.v[l])
            f.length[l] = seq.length[l]
        return f

    def truncate(self, seq, length):
        for l in range(self.n_layers):
            if seq.length[l] > length:
                k = torch.cat(seq.k[l])[:length]
                v = torch.cat(seq.v[l])[:length]
                seq.k[l], seq.v[l], seq.length[l] = [k], [v], length

    def free(self, seq):
        seq.k = seq.v = None

    def attend(self, layer, q, k, v, segments):
        B = len(segments)
        dev, cd = self.device, self.compute_dtype
        for s in segments:  # write before attend
            if s.pos != s.seq.length[layer]:
                raise ValueError(f"position {s.pos} is not the layer's length {s.seq.length[layer]}")
            s.seq.k[layer].append(k[s.start:s.start + s.n].to(self.dtype).to(dev))
            s.seq.v[layer].append(v[s.start:s.start + s.n].to(self.dtype).to(dev))
            s.seq.length[layer] += s.n
        max_q = max(s.n for s in segments)
        max_kv = max(s.seq.length[layer] for s in segments)
        g = self.hq // self.hkv
        Q = torch.zeros(B, self.hq, max_q, self.d, dtype=cd, device=dev)
        K = torch.zeros(B, self.hq, max_kv, self.d, dtype=cd, device=dev)
        V = torch.zeros(B, self.hq, max_kv, self.d, dtype=cd, device=dev)
        mask = torch.zeros(B, 1, max_q, max_kv, dtype=torch.bool, device=dev)
        for b, s in enumerate(segments):
            kk = torch.cat(s.seq.k[layer]).to(cd)
            vv = torch.cat(s.seq.v[layer]).to(cd)
            L = kk.shape[0]
            Q[b, :, :s.n] = q[s.start:s.start + s.n].to(self.dtype).to(dev, cd).transpose(0, 1)
            K[b, :, :L] = kk.repeat_interleave(g, dim=1).transpose(0, 1)
            V[b, :, :L] = vv.repeat_interleave(g, dim=1).transpose(0, 1)
            qpos = torch.arange(s.pos, s.pos + s.n, device=dev)
            mask[b, 0, :s.n, :L] = torch.arange(L, device=dev)[None, :] <= qpos[:, None]
        mask[:, :, :, 0] |= True  # padded query rows see one key: no NaN rows
        if self.sdpa is not None:
            O = self.sdpa(Q, K, V, attn_mask=mask, scale=self.scale)
        else:
            S = torch.matmul(Q, K.transpose(-1, -2)) * self.scale
            S = S.masked_fill(~mask, float("-inf"))
            O = torch.matmul(torch.softmax(S, dim=-1), V)
        o = torch.empty(q.shape, dtype=torch.float32)
        for b, s in enumerate(segments):
            o[s.start:s.start + s.n] = O[b, :, :s.n].transpose(0, 1).to(self.dtype).float().cpu()
        return o
