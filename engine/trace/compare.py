"""Two recorded turns side by side: where their answers part, their speed and bytes, what Quest picked in each
and how much the picks overlap, and how their sparse prefill masks differ. Plain numpy, no torch, no Qt.

    cmp = compare(rec_a, rec_b)            # the last turn of each (turn_a= / turn_b= pick others)
    cmp.first_difference                    # character index where the answers first differ (None: equal)
    cmp.figures                             # [(name, a, b, b / a)] time to first token, tok/s, bytes per token
    cmp.quest_jaccard                       # [layers, kv heads]: mean Jaccard of the picked pages, aligned steps
    cmp.parting_step                        # the first decode step whose input token differs (None: same, unknown)
    pick_raster(cmp.steps_a, cmp.steps_b, layer, kv_head)   # [steps, pages]: 1 A picked, 2 B picked, 3 both
    cmp.mask_density                        # ([layers, heads] of A, of B): the prefill masks' densities

Steps are aligned by their order in the turn: the k-th decode step of A with the k-th of B (the same position in
the answer while the answers agree). Decode step k reads answer token k, so from the first differing token on
(`parting_step`, from each turn's `token_ends`: the answer's length after each token) the two steps attend to
different text, and their picks differ for that reason too. Quest's picks are compared as sets of sequence pages
(positions), per layer and kv head, over the steps both have; a pick absent from one side (a dense layer, a policy
without picks) leaves NaN there. Recall (the attention mass a step kept) is listed when the recording measured it
(`recall=1`), per layer too (`layer_recall`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from engine.trace.events import DECODE, PREFILL, StepTrace
from engine.trace.recording import Recording


@dataclass
class Comparison:
    label_a: str
    label_b: str
    answer_a: str
    answer_b: str
    first_difference: int | None
    figures: list[tuple[str, float, float, float]]
    quest_jaccard: np.ndarray | None            # [layers, kv heads], NaN where a side has no pick
    quest_steps: int                            # aligned decode steps with picks on both sides
    quest_step_jaccard: np.ndarray              # [aligned decode steps]: mean over (layer, kv head), NaN: no pair
    parting_step: int | None                    # the first aligned decode step reading a different answer token
    mask_density: tuple[np.ndarray, np.ndarray] | None   # [layers, heads] per side, NaN where no mask
    notes: list[str] = field(default_factory=list)
    steps_a: list[StepTrace] = field(default_factory=list)
    steps_b: list[StepTrace] = field(default_factory=list)


def first_difference(a: str, b: str) -> int | None:
    """The first character index where `a` and `b` differ (the shorter one's end when one extends the other);
    None when they are equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _figures(turn: dict, steps: list[StepTrace]) -> dict[str, float]:
    s = turn.get("stats") or {}
    tokens = max(1, int(s.get("completion_tokens") or 0))
    decode = [x for x in steps if x.phase == DECODE]
    h2d = sum(float(x.metrics.get("bytes_h2d", 0.0)) for x in decode)
    recall = [x.metrics["quest_recall"] for x in decode if "quest_recall" in x.metrics]
    out = {"time to first token (s)": float(s.get("ttft_s", math.nan)),
           "prefill (tok/s)": float(s.get("prefill_tok_s", math.nan)),
           "decode (tok/s)": float(s.get("decode_tok_s", math.nan)),
           "KV host→device per decode step (MiB)": h2d / max(1, len(decode)) / 2 ** 20,
           "KV host→device in the turn (MiB)": float(s.get("bytes_h2d", h2d)) / 2 ** 20,
           "answer tokens": float(tokens)}
    if recall:
        out["Quest recall (attention mass kept)"] = float(np.mean(recall))
    return out


def _pages(pick) -> set[int]:
    return set(np.asarray(pick.positions if pick.positions is not None else pick.blocks).tolist())


def _picks(step: StepTrace) -> dict[tuple[int, int], set[int]]:
    return {(p.layer, p.kv_head): _pages(p) for p in step.quest}


def _pick(step: StepTrace | None, layer: int, kv_head: int) -> set[int]:
    return next((_pages(p) for p in step.quest if p.layer == layer and p.kv_head == kv_head), set()) if step else set()


def parting_token(ends_a: list[int], ends_b: list[int], at: int | None) -> int | None:
    """The index of the first answer token that differs, from the answers' lengths after each token and the first
    differing character `at`; None when the answers are equal or neither turn recorded its token ends."""
    if at is None:
        return None
    tokens = [next((i for i, end in enumerate(ends) if end > at), len(ends)) for ends in (ends_a, ends_b) if ends]
    return min(tokens) if tokens else None


def _decode_steps(steps: list[StepTrace]) -> list[StepTrace]:
    return [s for s in steps if s.phase == DECODE]


def quest_overlap(steps_a: list[StepTrace], steps_b: list[StepTrace]) -> tuple[np.ndarray | None, int, np.ndarray]:
    """Mean Jaccard |A ∩ B| / |A ∪ B| of the pages picked per (layer, kv head) over the aligned decode steps that
    have picks on both sides -> ([layers, kv heads] with NaN where a side never picked, steps compared, per aligned
    decode step the mean over its (layer, kv head)s with NaN where a side has no picks)."""
    pairs = list(zip(_decode_steps(steps_a), _decode_steps(steps_b)))
    sums: dict[tuple[int, int], list[float]] = {}
    per_step = np.full(len(pairs), np.nan)
    for k, (a, b) in enumerate(pairs):
        pa, pb = _picks(a), _picks(b)
        both = [len(pa[key] & pb[key]) / len(pa[key] | pb[key]) if pa[key] | pb[key] else 1.0
                for key in pa.keys() & pb.keys()]
        for key, v in zip(pa.keys() & pb.keys(), both):
            sums.setdefault(key, []).append(v)
        if both:
            per_step[k] = float(np.mean(both))
    n = int(np.isfinite(per_step).sum())
    if n == 0:
        return None, 0, per_step
    out = np.full((max(k[0] for k in sums) + 1, max(k[1] for k in sums) + 1), np.nan)
    for (l, h), v in sums.items():
        out[l, h] = float(np.mean(v))
    return out, n, per_step


def pick_raster(steps_a: list[StepTrace], steps_b: list[StepTrace], layer: int, kv_head: int) -> np.ndarray:
    """What A and B picked at one layer and kv head over the aligned decode steps: [steps, sequence pages] uint8,
    1 where A picked the page, 2 where B did, 3 where both did (0: neither, or a side without picks there)."""
    da, db = _decode_steps(steps_a), _decode_steps(steps_b)

    def at(steps: list[StepTrace], k: int) -> set[int]:
        return _pick(steps[k] if k < len(steps) else None, layer, kv_head)
    rows = [(at(da, k), at(db, k)) for k in range(max(len(da), len(db)))]
    width = max((max(a | b) + 1 for a, b in rows if a | b), default=0)
    out = np.zeros((len(rows), width), np.uint8)
    for k, (a, b) in enumerate(rows):
        out[k, sorted(a)] |= 1
        out[k, sorted(b)] |= 2
    return out


def layer_recall(steps: list[StepTrace], layer: int) -> float:
    """The attention mass Quest's picks kept at `layer`, mean over the decode steps that measured it (NaN: none)."""
    key = f"quest_recall_l{layer}"
    values = [s.metrics[key] for s in _decode_steps(steps) if key in s.metrics]
    return float(np.mean(values)) if values else math.nan


def mask_densities(steps: list[StepTrace]) -> np.ndarray | None:
    """The first prefill step with masks: density per (layer, head), NaN where none was recorded."""
    for s in steps:
        if s.phase == PREFILL and s.masks:
            out = np.full((max(m.layer for m in s.masks) + 1, max(m.head for m in s.masks) + 1), np.nan)
            for m in s.masks:
                out[m.layer, m.head] = m.density
            return out
    return None


def _pad(a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    out = np.full(shape, np.nan)
    out[:a.shape[0], :a.shape[1]] = a
    return out


def from_zero(steps: list[StepTrace]) -> list[StepTrace]:
    """Copies of `steps` with every time moved so that the first step starts at 0: two recordings' turns on one
    time scale (each recording has its own clock)."""
    if not steps:
        return []
    t0 = min(s.t0_us for s in steps)
    return [replace(s, t0_us=s.t0_us - t0, t1_us=s.t1_us - t0,
                    spans=[replace(x, t0_us=x.t0_us - t0, t1_us=x.t1_us - t0) for x in s.spans],
                    slots=[replace(x, t_us=x.t_us - t0) for x in s.slots],
                    windows=None if s.windows is None else [(w0 - t0, w1 - t0) for w0, w1 in s.windows])
            for s in steps]


def compare(a: Recording, b: Recording, turn_a: int = -1, turn_b: int = -1) -> Comparison:
    """Turn `turn_a` of recording `a` against turn `turn_b` of `b` (default: the last of each)."""
    notes = []
    if not a.turns or not b.turns:
        raise ValueError("a recording without a finished turn cannot be compared: record a turn first")
    ia, ib = turn_a % len(a.turns), turn_b % len(b.turns)
    ta, tb = a.turns[ia], b.turns[ib]
    sa, sb = a.turn_steps(ia), b.turn_steps(ib)
    if a.document != b.document:
        notes.append("the two recordings are of different documents: their prompts differ, so compare their "
                     "figures with care")
    if ta.get("question") != tb.get("question"):
        notes.append("the two turns ask different questions")
    ca, cb = ((t.get("stats") or {}).get("cached_tokens") for t in (ta, tb))
    if ca is not None and cb is not None and ca != cb:
        notes.append(f"A found {ca:,} prompt tokens in the prefix cache and B {cb:,}: their times to first token "
                     "differ for that too")
    fa, fb = _figures(ta, sa), _figures(tb, sb)
    figures = [(k, fa[k], fb.get(k, math.nan), fb.get(k, math.nan) / fa[k] if fa[k] else math.nan) for k in fa]
    jaccard, n, per_step = quest_overlap(sa, sb)
    at = first_difference(ta.get("answer", ""), tb.get("answer", ""))
    part = parting_token(*(list((t.get("stats") or {}).get("token_ends") or []) for t in (ta, tb)), at)
    ma, mb = mask_densities(sa), mask_densities(sb)
    masks = None
    if ma is not None or mb is not None:
        shape = tuple(max(x.shape[i] for x in (ma, mb) if x is not None) for i in (0, 1))
        masks = tuple(_pad(x, shape) if x is not None else np.full(shape, np.nan) for x in (ma, mb))
    return Comparison(a.label, b.label, ta.get("answer", ""), tb.get("answer", ""), at, figures, jaccard, n,
                      per_step, part, masks, notes, sa, sb)
