"""Sparse attention policies (DESIGN.md §2.3): the hooks the offload modes call."""
from engine.errors import ConfigError
from engine.sparse.policy import FullPolicy, KVLayout, PolicyContext, SparsePolicy
from engine.sparse.quest import QuestPolicy

POLICY_CLASSES = {"full": FullPolicy, "quest": QuestPolicy}
POLICY_MODES = {"full": ("gpu", "layerwise", "chunked"), "quest": ("layerwise",)}


def make_policy(name: str, params: dict | None, mode: str) -> SparsePolicy:
    """A policy by name, with its parameters; a clear error for an unknown one or one the mode cannot run."""
    if name not in POLICY_CLASSES:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_CLASSES)}")
    if mode not in POLICY_MODES[name]:
        raise ConfigError(f"the {name} policy runs in {' or '.join(POLICY_MODES[name])} mode, not {mode}: it picks "
                          "which host KV pages to load at each decode step (choose --mode layerwise)")
    try:
        return POLICY_CLASSES[name](**(params or {}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} policy: {e}") from None


__all__ = ["FullPolicy", "KVLayout", "PolicyContext", "QuestPolicy", "SparsePolicy", "make_policy", "POLICY_CLASSES"]
