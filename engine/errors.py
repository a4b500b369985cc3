"""Errors the engine raises for bad input. Each message names the problem and the fix."""


class KVScopeError(Exception):
    """Base class: a user-facing problem with a readable message (no traceback needed)."""


class ModelError(KVScopeError):
    """The model folder, its config, weights or tokenizer cannot be used."""


class ConfigError(KVScopeError):
    """An engine or sampling setting is invalid, or asks for hardware that is not there."""


class DocumentError(KVScopeError):
    """A document is empty, binary, unreadable, or too long for the model's context."""


class ContextTooLongError(DocumentError):
    """A prompt does not fit in the model's context or in the KV cache."""

    def __init__(self, message: str, tokens: int, limit: int):
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit


class OutOfMemoryError(KVScopeError):
    """The device ran out of memory; the message names the knob to turn."""


class Cancelled(KVScopeError):
    """The caller asked to stop (checked between layers and between steps)."""
