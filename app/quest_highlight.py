"""What Quest reads, shown in the document: the KV pages it chose for the newest decode step, as character ranges.

Qt-free and torch-free. Three pieces:

- `token_char_map(tokenizer, messages, prompt_ids, document)` (the worker, once per question): for each prompt
  token, its (start, end) characters in the document text, or (-1, -1) for tokens outside it (chat template,
  question, history). The chat template is rendered as text and tokenized with offsets; when that does not give
  exactly the prompt's ids (another tokenizer, a template that rewrites the content), there is no map and no
  highlight for that turn.
- `page_ranges(picks, token_map)`: a step's `QuestPick`s -> document ranges, each with its share of the
  (layer, kv head) picks that chose its page. Page j holds the sequence's tokens [j * page_size, (j + 1) *
  page_size); a page's text runs from its first document token to the next page's, so consecutive pages tile
  the text. Pages of equal share next to each other are merged; the ranges come sorted, never overlapping.
- `QuestHighlight`, which the window drives: a token map per turn (`new_turn`), engine steps (`feed`), and a
  document panel to draw on (`highlight_ranges(ranges, weights, scroll)`).

A pick recorded at decode step s is what its layer loads at step s + 1 (plus the newest block, which is not part
of the pick and is not highlighted); dense layers (below Quest's `dense_layers`) read everything and record no
picks, so the shares are over the sparse layers.
"""
from __future__ import annotations

import numpy as np

from engine.trace.events import DECODE

DOC_OPEN = "<document>\n"


def token_char_map(tokenizer, messages: list[dict], prompt_ids: list[int], document: str
                   ) -> tuple[np.ndarray | None, str]:
    """-> (int32 [n_tokens, 2] of document (start, end) per prompt token, -1 outside it; "") or (None, why not).

    Offsets are Python string indices into `document`; starts never decrease (byte-level tokens that split one
    character share it)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    except Exception as e:  # noqa: BLE001 - a tokenizer without offsets (slow) or a template that fails as text
        return None, f"no token offsets ({type(e).__name__})"
    if ids != list(prompt_ids):
        return None, "the rendered chat template does not tokenize to the prompt's ids"
    at = text.find(DOC_OPEN + document)
    at = at + len(DOC_OPEN) if at >= 0 else text.find(document)
    if at < 0 or not document:
        return None, "the document is not in the rendered prompt"
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2) - at
    off = np.clip(off, 0, len(document))
    inside = off[:, 1] > off[:, 0]
    off[:, 0] = np.maximum.accumulate(np.where(inside, off[:, 0], 0))
    return np.where(inside[:, None], off, -1).astype(np.int32), ""


def page_spans(token_map: np.ndarray, page_size: int) -> np.ndarray:
    """int64 [n_pages, 2]: each page's document characters (from its first document token to the next page's
    first, or to its own last token's end), (-1, -1) for pages without document tokens."""
    n = len(token_map)
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n
    starts = np.concatenate([token_map[:, 0].astype(np.int64), np.full(pad, -1)]).reshape(n_pages, page_size)
    ends = np.concatenate([token_map[:, 1].astype(np.int64), np.full(pad, -1)]).reshape(n_pages, page_size)
    has = (starts >= 0).any(axis=1)
    first = np.where(starts >= 0, starts, np.iinfo(np.int64).max).min(axis=1)
    last = ends.max(axis=1)
    first = np.where(has, first, -1)
    end = np.where(np.append(has[1:], False), np.append(first[1:], 0), last)   # the next page's start, else own end
    end = np.maximum(end, first)
    return np.where(has[:, None], np.stack([first, end], axis=1), -1)


def page_shares(picks) -> tuple[np.ndarray, np.ndarray, int]:
    """(page positions chosen by any pick, ascending; the share of picks choosing each; page size) of one step's
    picks (those that carry positions)."""
    picks = [p for p in picks if p.positions is not None and p.page_size]
    if not picks:
        return np.zeros(0, np.int64), np.zeros(0), 0
    pos = np.concatenate([np.unique(np.asarray(p.positions, dtype=np.int64).ravel()) for p in picks])
    pages, counts = np.unique(pos, return_counts=True)
    return pages, counts / len(picks), int(picks[0].page_size)


def page_ranges(picks, token_map: np.ndarray, min_share: float = 0.0, spans: np.ndarray | None = None
                ) -> tuple[list[tuple[int, int]], list[float]]:
    """One step's picks -> (document ranges [start, end), sorted and disjoint; the share of picks that chose
    each), for the pages chosen by more than `min_share` of the picks (every chosen page with 0). `spans`: the
    `page_spans` of this map and page size, when the caller keeps them."""
    pages, shares, page_size = page_shares(picks)
    if not len(pages) or token_map is None or not len(token_map):
        return [], []
    if spans is None:
        spans = page_spans(token_map, page_size)
    keep = (pages < len(spans)) & (shares > min_share)
    pages, shares = pages[keep], shares[keep]
    sel = spans[pages]
    keep = (sel[:, 0] >= 0) & (sel[:, 1] > sel[:, 0])
    ranges, weights = [], []
    for (start, end), w in zip(sel[keep].tolist(), shares[keep].tolist()):
        if ranges and ranges[-1][1] >= start and weights[-1] == w:
            ranges[-1] = (ranges[-1][0], max(end, ranges[-1][1]))
        elif ranges and ranges[-1][1] > start:          # not with tiling spans; kept disjoint anyway
            if end > ranges[-1][1]:
                ranges.append((ranges[-1][1], end))
                weights.append(w)
        else:
            ranges.append((start, end))
            weights.append(w)
    return ranges, weights


def utf16_shift(text: str) -> np.ndarray | None:
    """For each string index 0..len(text), the characters outside the BMP (emoji) before it: what a Qt text
    document, which counts UTF-16 units, adds to the index. None when there are none."""
    if text.isascii():
        return None
    wide = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32) >= 0x10000
    return np.concatenate([[0], np.cumsum(wide)]) if wide.any() else None


def utf16_ranges(ranges: list[tuple[int, int]], shift: np.ndarray | None) -> list[tuple[int, int]]:
    """Python string index ranges -> Qt text document positions (`shift` from `utf16_shift` of the text)."""
    if shift is None:
        return list(ranges)
    return [(s + int(shift[s]), e + int(shift[e])) for s, e in ranges]


class QuestHighlight:
    """Keeps the document panel's highlight on the pages Quest chose at the newest decode step of this turn.

    `new_turn(info)` with the worker's token map ({"map", "first_step"}, or None when this turn has none: not
    Quest, or no map) clears the highlight; `feed(steps)` (the window's tick) draws the newest decode step with
    picks; `clear()` when the document changes; `set_enabled(on)` from the menu toggle."""

    def __init__(self, panel, min_share: float = 0.0):
        self.panel, self.min_share = panel, min_share
        self.enabled = True
        self.reason = ""              # why the current turn has no map ("" when it has one, or none was asked)
        self._map: np.ndarray | None = None
        self._shift: np.ndarray | None = None    # utf16_shift of the document text
        self._first_step = 0
        self._spans: tuple[int, np.ndarray] | None = None   # (page size, page_spans) of the map
        self._step = None             # the newest decode StepTrace with picks of this turn
        self._drawn = None            # (step number, enabled) last drawn
        self._scrolled = False

    def new_turn(self, info: dict | None) -> None:
        info = info or {}
        self._map, self._shift = info.get("map"), utf16_shift(info.get("text", ""))
        self._first_step, self.reason = int(info.get("first_step", 0)), info.get("reason", "")
        self._spans, self._step, self._drawn, self._scrolled = None, None, None, False
        self.panel.highlight_ranges([])

    def clear(self) -> None:
        self.new_turn(None)

    def set_enabled(self, on: bool) -> None:
        self.enabled = bool(on)
        self._redraw()

    def feed(self, steps) -> None:
        if self._map is None:
            return
        for step in reversed(steps):
            if step.phase == DECODE and step.quest and step.step >= self._first_step:
                self._step = step
                self._redraw()
                return

    def show_step(self, step) -> None:
        """Highlight `step`'s picks (the Quest view's chosen step), if it is a decode step of this turn with picks."""
        if self._map is not None and step is not None and step.phase == DECODE and step.quest \
                and step.step >= self._first_step:
            self._step = step
            self._redraw()

    def current_step(self):
        """The decode step whose picks are highlighted (None before this turn has one)."""
        return self._step

    def ranges(self) -> tuple[list[tuple[int, int]], list[float]]:
        """The document ranges (Python string indices) and shares for the step held now."""
        if self._step is None or self._map is None:
            return [], []
        page_size = next((p.page_size for p in self._step.quest if p.page_size), 0)
        if self._spans is None or self._spans[0] != page_size:
            self._spans = (page_size, page_spans(self._map, page_size)) if page_size else None
        if self._spans is None:
            return [], []
        return page_ranges(self._step.quest, self._map, self.min_share, self._spans[1])

    def _redraw(self) -> None:
        key = (None if self._step is None else self._step.step, self.enabled)
        if key == self._drawn:
            return
        self._drawn = key
        if not self.enabled or self._step is None:
            self.panel.highlight_ranges([])
            return
        ranges, weights = self.ranges()
        self.panel.highlight_ranges(utf16_ranges(ranges, self._shift), weights, scroll=not self._scrolled)
        self._scrolled = self._scrolled or bool(ranges)
