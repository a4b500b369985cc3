"""nn.Linear whose one-row products on CUDA (a decode step's token) run our GEMV kernel (engine/ops/gemv.py);
prefill and the CPU keep F.linear. Same parameters and state-dict names as nn.Linear."""
import torch
from torch import nn

from engine.ops.gemv import glu_linear, linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def glu(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """self(silu_mul(x)), x [..., 2 * in_features] = [gate | up] (one kernel for one row on CUDA), into `out` if
        given."""
        return glu_linear(x, self.weight, self.bias, out)
