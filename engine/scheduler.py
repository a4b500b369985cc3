"""Prefill first, then decode; several sequences batched together in gpu mode (nano-vllm's policy)."""
from __future__ import annotations

from collections import deque

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: set[int], max_model_len: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences for this step, is_prefill)."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.bm.can_allocate(seq):
                break
            self.bm.allocate(seq)
            tokens += len(seq) - seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append(seq)
        if batch:
            return batch, True
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.bm.may_append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def _preempt(self, seq: Sequence) -> None:
        """Out of KV blocks: give this sequence's blocks back; it is recomputed later (prefix cache helps)."""
        seq.status = Status.WAITING
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        for seq, token in zip(seqs, token_ids):
            seq.append_token(token)
            p = seq.params
            if not p.ignore_eos and token in self.eos:
                self.finish(seq, "stop")
            elif seq.num_completion_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (done, or cancelled) and return its blocks; safe to call in any state."""
        if seq.is_finished:
            return
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.bm.deallocate(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
