"""A Llama-style decoder in pure torch (RMSNorm, RoPE, GQA attention, SwiGLU) whose attention
core is ``detattn.torch.Attention``: through detattnd or torch in-process, as the step's
``Batch`` says.

The model runs a *step*: the packed new tokens of several sequences at once (prefill chunks
and decode tokens together), laid out by a ``Batch``, and returns the logits of each
sequence's last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, asdict
from typing import Dict, List

import torch
from torch import nn

from . import safetensors
from .torch import Attention, Batch


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Seeded random weights: wq and wk scaled by sqrt(attn_gain) each, so attention scores
    # spread attn_gain times wider. 1: plain 1/sqrt(fan_in) weights, whose attention over a
    # long context is nearly uniform and hardly moves the logits; trained models attend
    # sharply, so a difference in attention's last bits can change their tokens.
    attn_gain: float = 1.0


CONFIGS: Dict[str, Config] = {
    # Small enough for a 2-core CPU daemon in CI.
    "tiny": Config(vocab=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512),
    # For the GPU experiment: Llama-shaped (dim = heads x head_dim, GQA 2:1) with the attention
    # of a small real model (16 q / 8 kv heads, d 64), two layers so 1000 samples take minutes.
    # Its attention is sharpened (attn_gain 4: scores of std 4, a few keys dominate) as in a
    # trained model.
    "small": Config(vocab=4096, dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=64, ffn_dim=2816,
                    attn_gain=4.0),
    # Shaped like Llama 3.2 1B (16 layers, 32 q / 8 kv heads, d 64, dim 2048, ffn 8192).
    "1b": Config(vocab=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                 rope_theta=500000.0),
    # Shaped like a 3B Llama (28 layers, 24 q / 8 kv heads, d 128, dim 3072).
    "3b": Config(vocab=32000, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192,
                 rope_theta=500000.0),
}


def daemon_flags(cfg: Config) -> List[str]:
    """detattnd flags for this model's attention."""
    return ["--layers", str(cfg.n_layers), "--q-heads", str(cfg.n_heads), "--kv-heads", str(cfg.n_kv_heads),
            "--head-dim", str(cfg.head_dim), "--dtype", "bf16"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [T, H, d] at positions pos [T] (half-split layout)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def linear(x: torch.Tensor, layer: nn.Linear, rows: int) -> torch.Tensor:
    """x @ W^T, batch-invariant when ``rows`` > 0: every matmul has exactly ``rows`` rows
    (the last chunk padded with zeros), so a row's bits never depend on how many rows the
    step has (BLAS and cuBLAS pick other kernels and blockings for other shapes, never for
    other values). 1 (or True): one row at a time (the CPU default); 0 (or False): one
    matmul for the step, as serving stacks do."""
    rows = int(rows)
    if rows <= 0:
        return layer(x)
    if rows == 1:
        return torch.cat([nn.functional.linear(x[i:i + 1], layer.weight) for i in range(x.shape[0])])
    return chunked(lambda c: nn.functional.linear(c, layer.weight), x, rows)


def chunked(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn over x [T, ...] in chunks of exactly ``rows`` rows (the last padded with zeros)."""
    T = x.shape[0]
    pad = (-T) % rows
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
    return torch.cat([fn(x[i:i + rows]) for i in range(0, T + pad, rows)])[:T]


def norm(layer: nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """RMSNorm, in fixed chunks of ``rows`` rows when ``rows`` > 1 (a GPU reduction may pick
    its launch shape from the number of rows)."""
    return chunked(layer, x, rows) if int(rows) > 1 else layer(x)


class Block(nn.Module):
    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.cfg = cfg
        self.rows = 1  # see linear()
        self.attn = Attention(layer)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = self.cfg
        rw = self.rows
        h = norm(self.attn_norm, x, rw)
        q = rope(linear(h, self.wq, rw).view(-1, c.n_heads, c.head_dim), pos, c.rope_theta)
        k = rope(linear(h, self.wk, rw).view(-1, c.n_kv_heads, c.head_dim), pos, c.rope_theta)
        v = linear(h, self.wv, rw).view(-1, c.n_kv_heads, c.head_dim)
        o = self.attn(q, k, v, batch)
        x = x + linear(o.reshape(-1, c.n_heads * c.head_dim), self.wo, rw)
        h = norm(self.ffn_norm, x, rw)
        return x + linear(nn.functional.silu(linear(h, self.w1, rw)) * linear(h, self.w3, rw), self.w2, rw)


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.rows = 1

    def set_rowwise(self, rowwise: bool) -> None:
        """Row-at-a-time matmuls (default): the model's own ops are then batch-invariant, so
        any difference between runs comes from attention alone."""
        self.set_rows(1 if rowwise else 0)

    def set_rows(self, rows: int) -> None:
        """How the model's own ops see a step's rows (see ``linear``): 1 one row at a time
        (the default; the CPU), C > 1 fixed chunks of C rows (the GPU: one launch per C rows,
        batch-invariant), 0 the whole step at once (not batch-invariant)."""
        for b in self.layers:
            b.rows = rows
        self.rows = rows

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @classmethod
    def random(cls, cfg: Config, seed: int = 0) -> "Transformer":
        """Seeded random weights (the same on every machine and torch version)."""
        m = cls(cfg)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    fan_in = p.shape[-1] if p.dim() > 1 else 1
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
                    if name.endswith(("wq.weight", "wk.weight")):
                        p.mul_(math.sqrt(cfg.attn_gain))
        return m.eval()

    def load_safetensors(self, path: str) -> None:
        """Loads weights saved with ``state_dict`` names (``detattn.safetensors``)."""
        t = safetensors.load(path)
        missing = set(self.state_dict()) - set(t)
        if missing:
            raise ValueError(f"{path}: missing tensors {sorted(missing)[:5]}")
        self.load_state_dict({k: v.float() for k, v in t.items() if k in self.state_dict()})

    def save_safetensors(self, path: str) -> None:
        safetensors.save({k: v for k, v in self.state_dict().items()}, path)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Runs the packed tokens [T] laid out by ``batch`` (each layer's attention is one
        call of ``batch.backend`` for all of them); returns the logits
        [len(batch.segments), vocab] of each segment's last token."""
        if tokens.shape[0] != batch.n_tokens:
            raise ValueError(f"{tokens.shape[0]} tokens for a batch of {batch.n_tokens}")
        dev = self.device
        pos = batch.positions().to(dev)
        x = self.embed(tokens.to(dev))
        for blk in self.layers:
            x = blk(x, pos, batch)
        rw = self.rows
        return linear(norm(self.norm, x[batch.last_rows().to(dev)], rw), self.head, rw).float()


def config_dict(cfg: Config) -> dict:
    return asdict(cfg)
