"""A small reader and writer of the safetensors format (8-byte little-endian header length,
a JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian data), for the
dtypes a Llama checkpoint uses. Debian has no python3-safetensors."""

from __future__ import annotations

import json
import struct
from typing import Dict

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32}
_NAMES = {v: k for k, v in _DTYPES.items()}


def load(path: str) -> Dict[str, torch.Tensor]:
    """Reads every tensor of a safetensors file. Raises ValueError on a malformed file."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError(f"{path}: header of {n} bytes past the end of the file")
    header = json.loads(raw[8:8 + n])
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(meta.get("dtype"))
        if dt is None:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {meta.get('dtype')}")
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= begin <= end <= len(data)) or end - begin != numel * torch.tensor([], dtype=dt).element_size():
            raise ValueError(f"{path}: tensor {name}: data_offsets {begin}..{end} do not match shape {shape}")
        buf = bytearray(data[begin:end])
        t = torch.frombuffer(buf, dtype=dt) if numel else torch.empty(0, dtype=dt)
        out[name] = t.reshape(shape).clone()
    return out


def save(tensors: Dict[str, torch.Tensor], path: str) -> None:
    """Writes tensors (contiguous, CPU) to a safetensors file."""
    header, chunks, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in chunks:
            f.write(b)
