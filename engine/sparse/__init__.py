"""Sparse attention policies (DESIGN.md §2.3): the hooks the offload modes call."""
from engine.sparse.policy import FullPolicy, PolicyContext, SparsePolicy

__all__ = ["FullPolicy", "PolicyContext", "SparsePolicy"]
