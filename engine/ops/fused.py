"""Elementwise pieces of a decoder layer, written as plain torch (the CPU path and the reference).

On CUDA each is compiled by torch.compile into one fused Triton kernel: at a 32K-token prefill the unfused
versions re-read activations many times over, and at decode their many small kernels cost more than the math.
Compilation is lazy (first CUDA call) and skipped on CPU. KVSCOPE_COMPILE=0 turns it off for debugging.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

COMPILE = os.environ.get("KVSCOPE_COMPILE", "1") != "0"


def cuda_compiled(fn):
    compiled = None

    @functools.wraps(fn)
    def run(x, *args):
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args)
        if compiled is None:  # importing torch's compiler costs seconds: only where it pays
            compiled = torch.compile(fn, dynamic=True) if COMPILE else fn
        return compiled(x, *args)
    return run


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32 (inlined into each compiled op below)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


@cuda_compiled
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return _rms(residual, weight, eps), residual


@cuda_compiled
def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place -> rms_norm(residual): no copy of the sum back into a caller's static buffer."""
    residual.add_(x)
    return _rms(residual, weight, eps)


@cuda_compiled
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. On CPU (eager) in place on gate_up, the projection's own output, where autograd does not
    watch it: two passes over it instead of three and no temporaries (a 7K-token prefill of the default model,
    2 cores: 49 -> 15 ms a layer)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.is_cuda or gate_up.requires_grad:
        return F.silu(gate) * up
    return F.silu(gate, inplace=True).mul_(up)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """Once per step, shared by every layer: cos, sin [T, 1, D] in the activations' dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin. On CPU (eager) without the rotated copy: two multiply-adds over the halves
    (a 7K-token prefill's q of the default model, 2 cores: 16.8 -> 7.8 ms a layer)."""
    x1, x2 = x.chunk(2, dim=-1)
    if x.is_cuda:
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    out = x * cos
    h = x.shape[-1] // 2
    out[..., :h].addcmul_(x2, sin[..., :h], value=-1.0)
    out[..., h:].addcmul_(x1, sin[..., h:])
    return out


@cuda_compiled
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half rotary on q [T, Hq, D] and k [T, Hkv, D]."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@cuda_compiled
def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3: per-head RMSNorm of q and k, then rotary; one kernel on CUDA."""
    return _rotate(_rms(q, q_weight, eps), cos, sin), _rotate(_rms(k, k_weight, eps), cos, sin)
