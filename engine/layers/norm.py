"""RMSNorm, optionally fused with the residual add (one read of each input)."""
from __future__ import annotations

import torch
from torch import nn

from engine.ops.fused import add_rms_norm, add_rms_norm_, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def add_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place -> norm(residual)."""
        return add_rms_norm_(x, residual, self.weight, self.eps)
