"""kvscope's inference engine: no Qt, importable and testable alone.

    from engine import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model (SmolLM2-135M-Instruct)
    for chunk in llm.stream("What is a KV cache?", SamplingParams(max_tokens=64)):
        print(chunk.text, end="")
"""
from engine.config import MODES, EngineConfig
from engine.errors import (ConfigError, ContextTooLongError, DocumentError, KVScopeError, ModelError,
                           OutOfMemoryError)
from engine.llm import LLM, Completion, GenerationStats, StreamChunk
from engine.sampling import SamplingParams

POLICIES = ("full",)  # sparse policies join here as they land

__all__ = ["LLM", "EngineConfig", "SamplingParams", "GenerationStats", "StreamChunk", "Completion", "MODES",
           "POLICIES", "KVScopeError", "ModelError", "ConfigError", "DocumentError", "ContextTooLongError",
           "OutOfMemoryError"]
