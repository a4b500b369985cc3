"""The next decode step's first layers, issued before this step's token reaches the host (layerwise).

Between two decode steps the GPU waited for the host: the sampler's sync, the host's bookkeeping of the step
(the policy's figures, the scheduler, the next step's context) and the launches of the next step's first layers,
~0.5 ms of a 12 ms Quest step at 128K on an H200. Where the step's first layers are resident and need nothing the
policy chooses (Quest's dense layers), they depend on nothing but the sampled token, which is on the device. So
the runner issues them right after this step's logits, from the device's token (greedy sampling only), and reads
the token through an event recorded before them (`Sampler.stage_greedy`): the GPU runs them while the host
finishes the step, and the next step starts at its first layer that needs the host.

The next step may not come: the token may end the answer, or another request may be scheduled. Its first layers
then wrote the new token's K and V into their resident buffers and decode buffers at the position after the
sequence's last one, which nothing reads before it is written again (a sequence's KV is valid up to its length;
the next prefill of those positions writes them). So nothing is undone: the issued state is dropped. Steps that
would offload a block, need a new one, end the answer by length or record a timeline are not issued ahead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence
from engine.step import StepContext
from engine.trace.recorder import NULL_RECORDER


class _Next:
    """The sequence as its next decode step sees it: one token longer, that token still on the device."""

    def __init__(self, seq: Sequence):
        self.block_table, self.num_cached_tokens = seq.block_table, seq.num_cached_tokens
        self._len = len(seq) + 1

    def __len__(self) -> int:
        return self._len


@dataclass
class Issued:
    seq_id: int
    length: int        # the sequence's length in the step issued (this step's + 1)
    layers: int        # its first layers that ran
    inputs: tuple      # the step's h, residual, pos, cos/sin, slots (decode graphs: the static h, residual)


class StepAhead:
    def __init__(self, runner):
        self.runner = runner
        self.enabled = runner.device.type == "cuda"   # (the CPU gains nothing: tests turn it on to check the path)
        self.issued: Issued | None = None
        self.steps = 0                                # steps whose first layers ran ahead (a figure for tools)

    def layers(self, seq: Sequence, ctx: StepContext) -> int:
        """How many of the next decode step's first layers may run now, after this decode step's logits (0: none)."""
        r = self.runner
        if not self.enabled or ctx.is_prefill:
            return 0
        p, L, bs, rec = seq.params, len(seq), r.block_size, ctx.recorder
        if (not p.greedy or p.leads or L % bs == 0 or (L + 1) % bs == 0 or L + 1 >= r.max_model_len
                or seq.num_completion_tokens + 1 >= p.max_tokens or rec.detail or rec.next_detailed()):
            return 0
        policy = r.policy
        if r.step_graphs.enabled and not policy.plans_loads:    # a whole step's graph may replay it
            return 0
        n = 0
        for l in range(len(r.model.layers)):
            if l not in r.oe.resident or (policy.plans_loads and (
                    policy.observes(l, L + 1) or policy.looks_ahead and policy.observes(l + 1, L + 1))):
                break
            n += 1
        return n

    def issue(self, seq: Sequence, ctx: StepContext, token: torch.Tensor, n: int) -> None:
        """Run the next step's first n layers from `token` (the sampled id on the device, [1])."""
        r, graphs, L = self.runner, self.runner.decode_graphs, len(seq)
        nxt = StepContext(ctx.step + 1, False, NULL_RECORDER, None, L + 1, ctx.block_table)
        if graphs is not None:
            graphs.begin_token(token, L)
            inputs = graphs.h, graphs.residual, None, None, None
        else:
            inputs = r.eager_inputs(None, L, L + 1, token.view(1))
        r._layers(_Next(seq), False, nxt, graphs, *inputs, stop=n)
        self.issued = Issued(seq.seq_id, L + 1, n, inputs)
        self.steps += 1

    def holds(self, seq: Sequence, is_prefill: bool) -> bool:
        """Are the layers issued ahead this step's (a decode step of that sequence at that length)?"""
        i = self.issued
        return i is not None and not is_prefill and i.seq_id == seq.seq_id and i.length == len(seq)

    def take(self, seq: Sequence, is_prefill: bool) -> Issued | None:
        """This step's layers issued ahead, if they are this step's (else dropped: see the module's docstring)."""
        issued, self.issued = (self.issued if self.holds(seq, is_prefill) else None), None
        return issued
