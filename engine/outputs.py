"""What a request gives back: the streamed text, and the stats of the turn."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from engine.sequence import Sequence


@dataclass
class GenerationStats:
    prompt_tokens: int
    cached_tokens: int          # prompt tokens whose KV came from the prefix cache
    completion_tokens: int
    ttft_s: float               # request start (incl. tokenization) to the first answer token
    prefill_tok_s: float        # computed (uncached) prompt tokens per second of prefill
    decode_tok_s: float         # answer tokens after the first, per second
    total_s: float
    finish_reason: str          # stop | length | cancelled
    bytes_h2d: int = 0          # KV bytes moved host -> device for this request (offload modes)
    bytes_d2h: int = 0          # KV bytes moved device -> host
    disk_cached_tokens: int = 0  # of the cached tokens, those read from the disk tier
    policy_stats: dict = field(default_factory=dict)  # the sparse policy's figures (density, pages selected, ...)
    token_ends: list[int] = field(default_factory=list)  # the answer's length in characters after each token

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StreamChunk:
    text: str                              # new answer text ("" in the final chunk)
    stats: GenerationStats | None = None   # set in the final chunk only


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    leads: list[float] = field(default_factory=list)   # per answer token, with SamplingParams(leads=True)


class Detokenizer:
    """Incremental decoding that never emits half a multi-byte character."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def request_stats(seq: Sequence, policy: dict) -> GenerationStats:
    end = seq.t_last_token or time.perf_counter()
    first = seq.t_first_token or end
    prefill_s = first - (seq.t_prefill_start or first)
    computed = seq.num_prompt_tokens - seq.num_cached_tokens
    decode_n = seq.num_completion_tokens - 1
    return GenerationStats(
        prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
        completion_tokens=seq.num_completion_tokens, ttft_s=first - seq.t_arrival,
        prefill_tok_s=computed / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decode_n / (end - first) if decode_n > 0 and end > first else 0.0,
        total_s=end - seq.t_arrival, finish_reason=seq.finish_reason or "cancelled",
        bytes_h2d=seq.bytes_h2d, bytes_d2h=seq.bytes_d2h, disk_cached_tokens=seq.disk_cached_tokens,
        policy_stats=policy)


def token_ends(tokenizer, ids: list[int]) -> list[int]:
    """The text's length in characters after each of `ids` (as streamed: a token that ends inside a multi-byte
    character adds nothing until the one that completes it); [] without a tokenizer."""
    if tokenizer is None:
        return []
    detok, ends = Detokenizer(tokenizer), []
    for t in ids:
        ends.append((ends[-1] if ends else 0) + len(detok.push(t)))
    return ends
