"""StepContext: what one forward step needs besides tensors, passed down the call.

The runner makes one per step and hands it to the model, the policy's hooks and the attention: the recorder
to report to, the cancel/progress handle, the phase and the step number, and (offload modes) the sequence's
host block table on the device and its length. Nothing of this is planted on modules: a CUDA graph capture,
for example, simply runs with a context that records nothing and cannot be cancelled.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.control import TaskState
from engine.trace.recorder import NULL_RECORDER, Recorder


@dataclass
class StepContext:
    step: int = 0
    is_prefill: bool = False
    recorder: Recorder = NULL_RECORDER
    task: TaskState | None = None       # cancel and progress of the request that runs (None: neither)
    context_len: int = 0                # tokens of the sequence with this step's (offload modes: one sequence)
    block_table: object = None          # offload modes: the sequence's host block ids, a device tensor (long)
    layer_keys: object = None           # for policies that want it: () -> the current layer's keys [Hkv, T, D]

    def layer_done(self, done: int, total: int) -> None:
        """`done` of `total` units of this step's work are finished: raises Cancelled once Stop was pressed,
        reports prefill progress. A host-side flag check, no device sync."""
        if self.task is not None:
            self.task.layer_done(done, total, self.is_prefill)


QUIET = StepContext()   # records nothing, cannot be cancelled (warm-ups, CUDA graph capture)
