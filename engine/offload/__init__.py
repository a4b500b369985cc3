"""CPU KV offload (DESIGN.md §2.1-2.2): the OffloadEngine and the two modes that drive it."""
from engine.offload.chunked import ChunkedRunner
from engine.offload.layerwise import LayerwiseRunner
from engine.offload.offload_engine import OffloadEngine
from engine.offload.planner import ResidencyPlan, plan_residency

__all__ = ["ChunkedRunner", "LayerwiseRunner", "OffloadEngine", "ResidencyPlan", "plan_residency"]
