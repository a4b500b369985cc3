"""Sparse attention policies (DESIGN.md §2.3): the hooks the engine's modes call."""
import json

from engine.errors import ConfigError
from engine.sparse.minference import MInferencePolicy
from engine.sparse.policy import FullPolicy, KVLayout, PolicyContext, SparsePolicy, SparsePrefillPolicy
from engine.sparse.quest import QuestPolicy
from engine.sparse.xattention import XAttentionPolicy

POLICY_CLASSES = {"full": FullPolicy, "quest": QuestPolicy, "minference": MInferencePolicy,
                  "xattention": XAttentionPolicy}
POLICY_MODES = {"full": ("gpu", "layerwise", "chunked"), "quest": ("layerwise", "chunked"),
                "minference": ("gpu", "layerwise"), "xattention": ("gpu", "layerwise")}
_WHY = {"quest": "it picks which host KV pages to load at each decode step",
        "minference": "it needs a layer's whole prompt at once to estimate its pattern",
        "xattention": "it needs a layer's whole prompt at once to score its blocks"}


def make_policy(name: str, params: dict | None, mode: str) -> SparsePolicy:
    """A policy by name, with its parameters; a clear error for an unknown one or one the mode cannot run."""
    if name not in POLICY_CLASSES:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_CLASSES)}")
    if mode not in POLICY_MODES[name]:
        modes = " or ".join(POLICY_MODES[name])
        raise ConfigError(f"the {name} policy runs in {modes} mode, not {mode}: {_WHY[name]} "
                          f"(choose --mode {' or --mode '.join(POLICY_MODES[name])})")
    try:
        return POLICY_CLASSES[name](**(params or {}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} policy: {e}") from None


def parse_policy_spec(spec: str) -> list[tuple[str, dict]]:
    """"full,quest:token_budget=1024:page_size=16" -> [("full", {}), ("quest", {"token_budget": 1024, ...})]
    (values are JSON numbers, or true/false)."""
    out = []
    for item in spec.split(","):
        name, *pairs = item.split(":")
        params = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            try:
                params[key] = json.loads(value.lower() if value in ("True", "False") else value)
            except json.JSONDecodeError:
                raise ConfigError(f"policy {name}: {pair!r} is not key=number (e.g. {name}:min_len=1024)") from None
            if not sep:
                raise ConfigError(f"policy {name}: {pair!r} is not key=value")
        out.append((name, params))
    return out


__all__ = ["FullPolicy", "KVLayout", "MInferencePolicy", "PolicyContext", "QuestPolicy", "SparsePolicy",
           "SparsePrefillPolicy", "XAttentionPolicy", "make_policy", "POLICY_CLASSES", "POLICY_MODES"]
