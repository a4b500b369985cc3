"""kvscope's inference engine: no Qt, importable and testable alone.

    from engine import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model (SmolLM2-135M-Instruct)
    for chunk in llm.stream("What is a KV cache?", SamplingParams(max_tokens=64)):
        print(chunk.text, end="")

Names are imported on first use, so `engine.errors` or `engine.trace` load without torch.
"""
from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm", "GenerationStats": "engine.outputs", "StreamChunk": "engine.outputs", "Completion": "engine.outputs",
    "EngineConfig": "engine.config", "MODES": "engine.config", "SamplingParams": "engine.sampling",
    "KVScopeError": "engine.errors", "ModelError": "engine.errors", "ConfigError": "engine.errors",
    "DocumentError": "engine.errors", "ContextTooLongError": "engine.errors", "OutOfMemoryError": "engine.errors",
    "Cancelled": "engine.errors", "TaskState": "engine.control",
}
__all__ = [*_EXPORTS, "POLICIES"]


def __getattr__(name: str):
    if name == "POLICIES":   # the policy names, from engine.sparse.specs (torch-free)
        from engine.sparse.specs import SPECS
        return tuple(SPECS)
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
