"""What Quest reports, a base of QuestPolicy (engine/sparse/quest.py) that reads the policy's layout, budget and
slots: with `recall` on, the true attention mass on what each sparse step attended to and on what its speculation
had loaded (from the layer's whole K); each step's figures for its trace (recall, pages fetched, pages kept: the
policy gathers them in `_step`, `end_step` reads the device's counts once a step); and a request's stats, recall
included (gathered in `_recall`)."""
from __future__ import annotations

import torch

from engine.step import StepContext


class QuestFigures:
    def stats(self) -> dict:
        """The request's figures: the budget's accounting, selections, pages fetched per step, and recall."""
        out = {"token_budget": self.token_budget, "page_size": self.page_size, "rank": self.rank,
               "bound_tokens": 0 if self.rank else self.bound_tokens,
               "sink": self.sink, "window": self.window, "pages_per_head": self.k, "dense_layers": self.dense_layers,
               "selections": self.selections, "sparse": self.plans > 0,
               "fetched_pages_per_step": self.fetched / self.fixes if self.fixes else 0.0,
               "fetched_ahead_pages_per_step": self.fetched_ahead / self.fixes if self.fixes else 0.0,
               "speculating_layers": sum(self._speculate[l] for l in self._chosen), "choosing_layers": len(self._chosen)}
        if not out["sparse"]:
            out["reason"] = self.dense_reason or "no decode step attended to part of the context"
        return out | self._recall_stats()

    def _measure_recall(self, layer: int, q: torch.Tensor, old: torch.Tensor, end: int, ctx: StepContext) -> None:
        """The true attention mass on what this step attended to (the speculation as corrected: what its rows
        hold) and on what was loaded before the layer's own query corrected it (`old`: the slots then), from the
        layer's whole K."""
        k = ctx.layer_keys()                                                   # [Hkv, end, D]
        ps, hkv = self.page_size, k.shape[0]
        window, _, _ = self._layout_for(end)
        slots = self._slots[layer]                                             # after the correction
        keep = torch.ones(self.k, ps, dtype=torch.bool, device=k.device)      # the last slot lost its tail
        keep[-1, ps - (window - self.window):] = False
        scale = self.layout.head_dim ** -0.5
        for kind, pages in (("recall", slots), ("recall_speculative", old)):
            attended = torch.zeros(hkv, end, dtype=torch.bool, device=k.device)
            attended[:, :self.sink] = True
            attended[:, end - window:] = True
            tokens = (pages[:, :, None] * ps + self._in_page)[:, keep]
            attended.scatter_(1, tokens.masked_fill_(pages.repeat_interleave(keep.sum(1), 1) < 0, end - 1), True)
            r = self.recall(q, k, attended, scale)
            self.note_recall(layer, r, kind)
            self._step.setdefault(kind, {})[layer] = r.mean().item()

    def step_metrics(self) -> dict:
        """This step's figures for its trace, per kv head: recall (`quest_recall`: mean over the sparse layers,
        `quest_recall_min`, `quest_recall_l<layer>`), pages fetched by the correction (`quest_fetched`,
        `quest_fetched_l<layer>`: exposed, right before the attention) and one layer ahead
        (`quest_fetched_ahead...`: on the copy stream), and pages of the previous choice kept (`quest_kept...`)."""
        step, self._step = self._step, {}
        out = {}
        for kind, name in (("recall", "quest_recall"), ("fetched", "quest_fetched"),
                           ("fetched_ahead", "quest_fetched_ahead"), ("kept", "quest_kept")):
            per = step.get(kind)
            if per:
                out[name] = sum(per.values()) / len(per)
                out.update({f"{name}_l{l}": v for l, v in per.items()})
                if kind == "recall":
                    out[name + "_min"] = min(per.values())
        return out

    def recall(self, q: torch.Tensor, keys: torch.Tensor, loaded: torch.Tensor, scale: float) -> torch.Tensor:
        """The share of the true attention mass on the tokens that were loaded, per query head.

        q [Hq, D]; keys [Hkv, T, D], all of the layer's keys (the current token's last); loaded [Hkv, T] bool."""
        hkv, t, d = keys.shape
        qg = q.float().reshape(hkv, -1, d)                                          # [Hkv, G, D]
        p = torch.softmax(qg @ keys.float().transpose(1, 2) * scale, dim=-1)        # [Hkv, G, T]
        return (p * loaded[:, None]).sum(-1).flatten()

    def note_recall(self, layer: int, value: torch.Tensor, kind: str = "recall") -> None:
        self._recall.setdefault(kind, {}).setdefault(layer, []).append(value)

    def _recall_stats(self) -> dict:
        """The recall measured over the request: mean over the sparse layers, lowest query head, per layer."""
        out = {}
        for kind, layers in self._recall.items():
            per_layer = {l: torch.cat(v).mean().item() for l, v in sorted(layers.items())}
            out[kind] = sum(per_layer.values()) / len(per_layer)
            out[kind + "_min_head"] = min(torch.cat(v).min().item() for v in layers.values())
            out[kind + "_per_layer"] = {str(l): round(r, 4) for l, r in per_layer.items()}
        return out

    def end_step(self, ctx: StepContext) -> None:
        """Once per step: the step's picks go to the recorder stacked (three copies to the host, asynchronous);
        the pages the corrections fetched and kept are read (copied by stage_step, else one small copy)."""
        picked, self._picked = self._picked, []
        if picked and ctx.recorder.enabled:
            at = slice(picked[0], picked[-1] + 1) if picked == list(range(picked[0], picked[-1] + 1)) else picked
            positions = self._pages[at]
            ctx.recorder.quest_picks(picked, self._page_ids[positions], self._scores[at],
                                     [self._n_candidates] * len(picked), positions, self.page_size)
        fixed, self._fixed = self._fixed, []
        chose, self._chose = self._chose, []
        staged, self._staged = self._staged, False
        if fixed or chose:
            if staged:                             # copied before the sampler's sync: on the host now
                fetched, kept = self._counts_host
                (fixes, ahead), kept = fetched.tolist(), kept.sum(1).tolist()
            else:                                  # (the CPU, or a step nothing staged: one small copy)
                fixes, ahead, kept = torch.cat([self._fetched, self._kept.sum(1)[None]]).tolist()
            self._fetched.zero_()
            hkv, ps = self.layout.num_kv_heads, self.page_size
            self._rows_step = int(sum(fixes) + sum(ahead))
            fixes, ahead = [r / ps for r in fixes], [r / ps for r in ahead]
            for l in chose:                        # load the previous choice ahead where it kept half its pages
                self._speculate[l] = kept[l] / hkv >= self.k / 2
            per_layer = {l: fixes[l] / hkv for l in fixed}
            early = {l: ahead[l] / hkv for l in fixed if self._ahead_at.get(l) == ctx.context_len}
            self._step["fetched"], self._step["fetched_ahead"] = per_layer, early
            self._step["kept"] = {l: kept[l] / hkv for l in chose}
            self.fetched += sum(per_layer.values())
            self.fetched_ahead += sum(early.values())
            self.fixes += len(per_layer)

    def stage_step(self) -> None:
        """CUDA, before the sampler's sync: the step's counts (rows fetched per layer, pages kept per kv head) to
        pinned host copies, so that end_step reads them without a sync of its own (before, three small kernels and
        a synchronous copy ran after the sampler's sync, between the steps)."""
        if not (self._fixed or self._chose) or self._fetched.device.type != "cuda":
            return
        if self._counts_host is None:
            self._counts_host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                      for t in (self._fetched, self._kept))
        for host, dev in zip(self._counts_host, (self._fetched, self._kept)):
            host.copy_(dev, non_blocking=True)
        self._staged = True

    def fetched_rows(self) -> int:
        rows, self._rows_step = self._rows_step, 0
        return rows
