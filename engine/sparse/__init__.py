"""Sparse attention policies (DESIGN.md §2.3). Importing this package loads no torch: the specs (what each
policy is and takes) are torch-free, the implementations are imported when a policy is made."""
import json
from importlib import import_module

from engine.errors import ConfigError
from engine.sparse.specs import SPECS, Param, PolicySpec, get_spec, make_policy, policy_class

_LAZY = {"SparsePolicy": "engine.sparse.policy", "FullPolicy": "engine.sparse.policy",
         "SparsePrefillPolicy": "engine.sparse.policy", "KVLayout": "engine.sparse.policy",
         "LoadPlan": "engine.sparse.policy", "QuestPolicy": "engine.sparse.quest",
         "MInferencePolicy": "engine.sparse.minference", "XAttentionPolicy": "engine.sparse.xattention"}


def parse_policy_spec(spec: str) -> list[tuple[str, dict]]:
    """"full,quest:token_budget=1024:page_size=16" -> [("full", {}), ("quest", {"token_budget": 1024, ...})]
    (values are JSON numbers, or true/false); each checked against the policy's spec."""
    out = []
    for item in spec.split(","):
        name, *pairs = item.split(":")
        params = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ConfigError(f"policy {name}: {pair!r} is not key=value")
            try:
                params[key] = json.loads(value.lower() if value in ("True", "False") else value)
            except json.JSONDecodeError:
                raise ConfigError(f"policy {name}: {pair!r} is not key=number (e.g. {name}:min_len=1024)") from None
        get_spec(name).validate(params)
        out.append((name, params))
    return out


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine.sparse' has no attribute {name!r}")


__all__ = ["SPECS", "Param", "PolicySpec", "get_spec", "make_policy", "parse_policy_spec", "policy_class", *_LAZY]
