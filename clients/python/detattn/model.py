"""A Llama-style decoder in pure torch (RMSNorm, RoPE, GQA attention, SwiGLU) whose attention
goes through an ``AttentionBackend`` (``detattn.torch``): detattnd or torch in-process.

The model runs a *step*: the packed new tokens of several sequences at once (prefill chunks
and decode tokens together), described by ``Segment``s, and returns the logits of each
segment's last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, asdict
from typing import Dict, List, Optional

import torch
from torch import nn

from . import safetensors
from .torch import AttentionBackend, Segment


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


CONFIGS: Dict[str, Config] = {
    # Small enough for a 2-core CPU daemon in CI.
    "tiny": Config(vocab=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512),
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
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def linear(x: torch.Tensor, layer: nn.Linear, rowwise: bool) -> torch.Tensor:
    """x @ W^T; rowwise: one row at a time, so a row's bits never depend on how many rows
    the step has (BLAS may pick other blocking for other shapes)."""
    if not rowwise:
        return layer(x)
    return torch.cat([nn.functional.linear(x[i:i + 1], layer.weight) for i in range(x.shape[0])])


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.rowwise = True
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x, pos, layer, attn: AttentionBackend, segments):
        c = self.cfg
        rw = self.rowwise
        h = self.attn_norm(x)
        q = rope(linear(h, self.wq, rw).view(-1, c.n_heads, c.head_dim), pos, c.rope_theta)
        k = rope(linear(h, self.wk, rw).view(-1, c.n_kv_heads, c.head_dim), pos, c.rope_theta)
        v = linear(h, self.wv, rw).view(-1, c.n_kv_heads, c.head_dim)
        o = attn.attend(layer, q, k, v, segments)
        x = x + linear(o.reshape(-1, c.n_heads * c.head_dim), self.wo, rw)
        h = self.ffn_norm(x)
        return x + linear(nn.functional.silu(linear(h, self.w1, rw)) * linear(h, self.w3, rw), self.w2, rw)


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def set_rowwise(self, rowwise: bool) -> None:
        """Row-at-a-time matmuls (default): the model's own ops are then batch-invariant, so
        any difference between runs comes from attention alone."""
        for b in self.layers:
            b.rowwise = rowwise

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
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, attn: AttentionBackend,
             segments: List[Segment]) -> torch.Tensor:
        """Runs the packed tokens [T] at positions [T]; returns logits [len(segments), vocab]
        of each segment's last token."""
        x = self.embed(tokens)
        for i, blk in enumerate(self.layers):
            x = blk(x, pos, i, attn, segments)
        last = torch.tensor([s.start + s.n - 1 for s in segments])
        return linear(self.norm(x[last]), self.head, self.layers[0].rowwise if len(self.layers) else False).float()


def config_dict(cfg: Config) -> dict:
    return asdict(cfg)
