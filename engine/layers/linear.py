"""nn.Linear whose one-row products on CUDA (a decode step's token) run our GEMV kernel (engine/ops/gemv.py);
prefill and the CPU keep F.linear. Same parameters and state-dict names as nn.Linear."""
import torch
from torch import nn

from engine.ops.gemv import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, into `out` if given."""
        return linear(x, self.weight, self.bias, out)
