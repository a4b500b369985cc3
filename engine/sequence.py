"""One request: its tokens, its KV blocks, its sampling settings and its timings."""
from __future__ import annotations

import time
from enum import Enum, auto
from itertools import count

from engine.sampling import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = Status.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0          # prompt tokens whose KV came from the prefix cache
        self.disk_cached_tokens = 0         # ... of them read from the disk tier
        self.disk_checked = False           # the disk tier has looked for this prompt's pages
        self.block_table: list[int] = []
        self.block_size = block_size
        self.params = params
        self.finish_reason: str | None = None   # "stop" | "length" | "cancelled"
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None
        self.t_prefill_start: float | None = None
        self.bytes_h2d = 0                  # KV bytes this request moved host -> device (offload modes)
        self.bytes_d2h = 0
        self.leads: list[float] = []        # per answer token, when params.leads: top logit - the second

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        now = time.perf_counter()
        if self.t_first_token is None:
            self.t_first_token = now
        self.t_last_token = now
        self.token_ids.append(token_id)
