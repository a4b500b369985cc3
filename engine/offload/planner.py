"""Residency plan for layerwise mode: which layers keep their KV on the device, which stream through the ring.

Every layer needs a whole-sequence buffer while it computes. With a device KV budget, as many layers as fit
(after the ring and the decode buffer) stay resident and are never loaded again; the rest stream through a
ring of N slots. Layers the policy reads in full every step (Quest's dense layers) are resident first; the
others are spread evenly over the depth, so the streamed ones between them get the resident layers' compute
time to load in.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import OutOfMemoryError


@dataclass(frozen=True)
class ResidencyPlan:
    num_layers: int
    ring_slots: int                 # N (0 when every layer is resident)
    resident: tuple[int, ...]       # layers whose KV stays on the device
    layer_bytes: int                # one layer's buffer (the whole sequence)
    dbuf_bytes: int                 # the decode buffer (one block per layer)
    budget_bytes: int | None

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.resident))

    @property
    def device_bytes(self) -> int:
        return (self.ring_slots + len(self.resident)) * self.layer_bytes + self.dbuf_bytes

    def describe(self) -> str:
        gib = 2**30
        budget = "no GPU KV budget set" if self.budget_bytes is None else f"budget {self.budget_bytes / gib:.2f} GiB"
        return (f"layerwise plan: {len(self.resident)} of {self.num_layers} layers resident, "
                f"{len(self.streamed)} streamed through a ring of {self.ring_slots} slots of "
                f"{self.layer_bytes / gib:.3f} GiB; device KV {self.device_bytes / gib:.2f} GiB ({budget})")

    def to_dict(self) -> dict:
        return {"ring_slots": self.ring_slots, "resident_layers": list(self.resident),
                "streamed_layers": len(self.streamed), "layer_bytes": self.layer_bytes,
                "device_kv_bytes": self.device_bytes, "budget_bytes": self.budget_bytes}


def plan_residency(num_layers: int, ring_slots: int, layer_bytes: int, dbuf_bytes: int,
                   budget_bytes: int | None, prefer: tuple[int, ...] = ()) -> ResidencyPlan:
    ring_slots = min(ring_slots, num_layers)
    if budget_bytes is None:
        return ResidencyPlan(num_layers, ring_slots, (), layer_bytes, dbuf_bytes, None)
    if budget_bytes >= num_layers * layer_bytes + dbuf_bytes:
        return ResidencyPlan(num_layers, 0, tuple(range(num_layers)), layer_bytes, dbuf_bytes, budget_bytes)
    floor = ring_slots * layer_bytes + dbuf_bytes
    if budget_bytes < floor:
        raise OutOfMemoryError(
            f"the GPU KV budget of {budget_bytes / 2**30:.2f} GiB is below the ring alone ({ring_slots} slots of "
            f"{layer_bytes / 2**30:.2f} GiB + decode buffer = {floor / 2**30:.2f} GiB): raise gpu_kv_budget_gb "
            "(--gpu-kv-budget), lower ring_slots (--ring-slots) or max_model_len (--max-model-len)")
    n = min(num_layers - ring_slots, (budget_bytes - floor) // layer_bytes)
    first = tuple(sorted(prefer))[:n]
    rest = [l for l in range(num_layers) if l not in first]
    m = n - len(first)
    resident = tuple(sorted(first + tuple(rest[int((i + 0.5) * len(rest) / m)] for i in range(m)))) if n > 0 else ()
    return ResidencyPlan(num_layers, ring_slots, resident, layer_bytes, dbuf_bytes, budget_bytes)
