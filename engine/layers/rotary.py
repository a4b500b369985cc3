"""Rotary position embedding (rotate-half layout, as Hugging Face checkpoints expect).

Supported scalings: none ("default"), "linear", and Llama 3's frequency-dependent "llama3"
(Meta's formula: long wavelengths are divided by `factor`, short ones kept, a smooth blend between).
cos/sin are computed from the positions once per step: no table sized by the maximum context.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.errors import ModelError
from engine.ops.fused import rope_cos_sin

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """On the CPU, even inside a `torch.device("meta")` block (on meta, arange imports torch._dynamo: ~3 s)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled).float()
    raise ModelError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; cos/sin are computed once per step (see `cos_sin`) and shared by all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.inv_freq, dtype)
