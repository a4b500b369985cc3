"""The one face every execution mode's runner has (DESIGN.md §2.1), and the factory that picks one.

`LLM`, the scheduler, the block manager and the disk tier talk to a `Runner` and never ask which mode runs:
gpu (engine/model_runner.py), layerwise and chunked (engine/offload/).
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.layers.sampler import Sampler
from engine.models.llama import CausalLM
from engine.offload.planner import ResidencyPlan
from engine.sequence import Sequence
from engine.sparse.policy import SparsePolicy
from engine.step import StepContext
from engine.trace.recorder import Recorder


class Runner(Protocol):
    num_blocks: int                     # KV blocks it holds (paged on the device, or in the host pool)
    block_size: int
    block_bytes: int                    # one block across all layers
    max_num_batched_tokens: int
    policy: SparsePolicy
    sampler: Sampler
    plan: ResidencyPlan | None          # layerwise: which layers stay on the device

    def run(self, seqs: list[Sequence], is_prefill: bool, ctx: StepContext) -> list[int]:
        """One step: the next token of each sequence."""

    def issued_for(self, seqs: list[Sequence], is_prefill: bool) -> bool:
        """Did this step's first layers run already, after the last step's logits (its timeline then: none)?"""

    def set_policy(self, policy: SparsePolicy) -> None:
        """The policy of the next requests (between requests only)."""

    def step_metrics(self) -> dict:
        """Figures of the step that just ran, for its trace (bytes moved, the policy's)."""

    # the KV memory, as the disk tier sees it
    def block(self, block_id: int) -> torch.Tensor:
        """One block's KV across the layers, [L, 2, Hkv, bs, D], a view."""

    def written(self, block_ids: list[int]) -> None:
        """These blocks were filled from outside the model."""

    def sync(self) -> None:
        """The KV computed so far is in memory."""

    def close(self) -> None:
        """Join every thread it started and free what it pinned; idempotent."""


def make_runner(model: CausalLM, cfg: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                policy: SparsePolicy, rec: Recorder) -> Runner:
    if cfg.mode == "gpu":
        from engine.model_runner import ModelRunner
        return ModelRunner(model, cfg, device, dtype, max_model_len, policy, rec)
    from engine.offload import ChunkedRunner, LayerwiseRunner
    kind = LayerwiseRunner if cfg.mode == "layerwise" else ChunkedRunner
    return kind(model, cfg, device, dtype, max_model_len, policy, rec)
