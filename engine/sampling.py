"""Sampling parameters, validated with readable messages."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass
class SamplingParams:
    temperature: float = 0.0    # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    max_tokens: int = 256
    seed: int | None = None     # per-request generator; None = nondeterministic
    ignore_eos: bool = False
    leads: bool = False         # record each token's top logit lead over the runner-up (Completion.leads)

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise ConfigError(f"temperature must be between 0 (greedy) and 100 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be 0 (off) or positive (got {self.top_k})")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens (--max-new-tokens) must be at least 1 (got {self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
