"""Token sampling: greedy, temperature, top-k, top-p, with an optional per-request seed.

Random draws use the exponential-race form of sampling (argmax of p / Exp(1) noise), one generator per
seeded request, so a seeded request gives the same tokens whatever else is in the batch.
"""
from __future__ import annotations

import torch

from engine.sampling import SamplingParams


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self.leads: dict[int, float] = {}   # the last call's rows that asked (`leads`): top logit - the second
        self._host: torch.Tensor | None = None   # stage_greedy's pinned tokens and the event they landed with
        self._landed = None

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> list[int]:
        """logits [B, V] (any float dtype) -> one token id per row."""
        want = [i for i, p in enumerate(params) if p.leads]
        if want:            # how sure the model was: small leads are near-ties that any change may flip
            top = logits[want].float().topk(2, dim=-1).values
            self.leads = dict(zip([seq_ids[i] for i in want], (top[:, 0] - top[:, 1]).tolist()))
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        tokens = []
        for row, p, sid in zip(logits.float(), params, seq_ids):
            tokens.append(int(row.argmax()) if p.greedy else self._sample(row, p, sid))
        return tokens

    def stage_greedy(self, logits: torch.Tensor):
        """Greedy tokens started for the host without waiting for the stream -> (the tokens on the device [B],
        read() -> list[int]). CUDA: a copy to pinned memory and an event, so that work issued between the two calls
        (the next step's first layers) does not delay read(), as a `.tolist()` there would wait for it too."""
        tokens = logits.argmax(dim=-1)
        if tokens.device.type != "cuda":
            return tokens, tokens.tolist
        if self._host is None or self._host.numel() < tokens.numel():
            self._host = torch.empty(tokens.numel(), dtype=tokens.dtype, pin_memory=True)
            self._landed = torch.cuda.Event()
        host = self._host[:tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        self._landed.record()

        def read() -> list[int]:
            self._landed.synchronize()
            return host.tolist()
        return tokens, read

    def _sample(self, logits: torch.Tensor, p: SamplingParams, seq_id: int) -> int:
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        noise = torch.empty_like(probs).exponential_(generator=self._generator(seq_id, p.seed))
        return int((probs / noise).argmax())

    def _generator(self, seq_id: int, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if seq_id not in self._generators:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[seq_id] = g
        return self._generators[seq_id]
