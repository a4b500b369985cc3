"""Quest page selection: for one decode step, which KV pages each sparse layer chose (layers × pages heatmap).

One uint8 `ImageItem` (fixed levels, a lookup table from the background to the selection colour), rows = the
layers that recorded picks, columns = global page ids from the step's smallest to its largest picked id (the
blocks of one sequence are mostly consecutive ids, so this is close to sequence order). Modes: "selected" (lit
where chosen) and "scores" (the chosen pages' scores, their estimated attention share, normalised per row).
One kv head, or "all heads" (the fraction of heads choosing each page). A slider scrubs the recorded decode steps
that carry picks; at the newest one it follows new steps. The pick recorded at step s is what its layer loads at
step s + 1 (plus the newest block's pages, which are not part of the pick). With Quest's recall measured
(`recall=True`), step s + 1 records the share of the true attention mass that those pages held: the caption and
the hover show it.
"""
from __future__ import annotations

from collections import deque

import numpy as np
from PySide6.QtCore import QRectF, Qt
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QSlider, QWidget

from engine.trace.events import DECODE, QuestPick, StepTrace
from widgets.heatmap_view import HeatmapView
from widgets.trace_common import KIND_COLORS, apply_heatmap_palette, fmt_pct

NO_PICKS_HINT = "no Quest picks: choose the Quest policy in layerwise mode"
PICK_COLOR = KIND_COLORS["layer"]
MAX_STEPS = 500
ALL_HEADS = -1
MODES = ("selected", "scores")
LOW = 0.25           # score mode: the lowest-scoring chosen page still shows this much colour


class QuestView(HeatmapView):
    """API: `set_steps(steps)`, `append_steps(steps)` (decode steps with picks; the last `max_steps` kept),
    `clear()`, `set_kv_head(h)` (ALL_HEADS = -1 for the fraction of heads), `set_mode("selected"|"scores")`,
    `set_step_index(i)`; read back `image()` (the uint8 array shown, rows = `layers()`, column j = page id
    `first_page() + j`), `current_step()`, `recall()`, `kv_head()`, `step_count()`, `showing_hint()`,
    `caption.text()`."""

    def __init__(self, max_steps: int = MAX_STEPS, parent: QWidget | None = None):
        super().__init__(parent)
        self._steps: deque[StepTrace] = deque(maxlen=max_steps)
        self._index = -1
        self._follow = True
        self._image = np.zeros((0, 0), dtype=np.uint8)
        self._layers: list[int] = []
        self._first = 0
        self._picks: dict[tuple[int, int], QuestPick] = {}
        self._n_heads = 0

        self.head_combo = QComboBox(toolTip="The kv head whose picks are shown, or the fraction of heads")
        self.mode_combo = QComboBox(toolTip="Selected pages, or their scores (estimated attention share) normalised "
                                    "per layer")
        for m in MODES:
            self.mode_combo.addItem(m, m)
        self.slider = QSlider(Qt.Orientation.Horizontal, minimum=0, maximum=0)
        self.slider.setToolTip("Recorded decode steps with Quest picks (newest on the right)")
        self.follow_check = QCheckBox("follow live", checked=True)
        self._heatmap("page id", "layer", "quest")   # the first layer on top

        controls = QHBoxLayout()
        controls.addWidget(QLabel("kv head"))
        controls.addWidget(self.head_combo)
        controls.addWidget(self.mode_combo)
        controls.addWidget(self.slider, 1)
        controls.addWidget(self.follow_check)
        self._layout(controls, hint=NO_PICKS_HINT)

        self.head_combo.currentIndexChanged.connect(lambda *_: self._redraw())
        self.mode_combo.currentIndexChanged.connect(lambda *_: self._redraw())
        self.slider.valueChanged.connect(self.set_step_index)
        self.follow_check.toggled.connect(self._on_follow)
        self._apply_palette()

    # ---------------------------------------------------------------- palette
    def _apply_palette(self) -> None:
        """Background and axes from the palette; the lookup table runs from the background to PICK_COLOR."""
        apply_heatmap_palette(self, (self.plot,), self.img, PICK_COLOR)

    # ---------------------------------------------------------------- history
    def set_steps(self, steps) -> None:
        """Show these steps' picks (decode steps with picks only), replacing what was shown; newest selected."""
        self._steps.clear()
        self._steps.extend(s for s in steps if s.phase == DECODE and s.quest)
        self._index, self._follow = len(self._steps) - 1, True
        self._sync_controls()
        self._redraw()

    def append_steps(self, steps) -> None:
        """Add new steps (oldest first); the newest is shown when following, else the step shown stays."""
        new = [s for s in steps if s.phase == DECODE and s.quest]
        if not new:
            return
        shown = self.current_step()
        self._steps.extend(new)
        if self._follow or shown is None:
            self._index = len(self._steps) - 1
        else:
            self._index = next((i for i, s in enumerate(self._steps) if s is shown), 0)
        self._sync_controls()
        self._redraw()

    def clear(self) -> None:
        self._steps.clear()
        self._index, self._follow = -1, True
        self._sync_controls()
        self._redraw()

    def step_count(self) -> int:
        return len(self._steps)

    def set_dense_reason(self, reason: str | None) -> None:
        """Why the last turn's Quest attended to everything (the policy's stats say `sparse: false, reason`), shown
        in place of the picks it did not make; None: the usual hint."""
        self.hint_label.setText(f"Quest loaded everything this turn: {reason}" if reason else NO_PICKS_HINT)

    def current_step(self) -> StepTrace | None:
        return self._steps[self._index] if 0 <= self._index < len(self._steps) else None

    def set_step_index(self, i: int) -> None:
        """Show the i-th recorded step with picks (negative counts from the newest); follows at the newest."""
        if not self._steps:
            return
        i = max(0, min(len(self._steps) - 1, i if i >= 0 else len(self._steps) + i))
        self._index = i
        self._follow = i == len(self._steps) - 1
        self._sync_controls()
        self._redraw()

    def _on_follow(self, on: bool) -> None:
        if on:
            self.set_step_index(-1)
        elif self._follow and self._steps:
            self._follow = False

    def _sync_controls(self) -> None:
        for w in (self.slider, self.follow_check):
            w.blockSignals(True)
        self.slider.setMaximum(max(0, len(self._steps) - 1))
        self.slider.setValue(max(0, self._index))
        self.follow_check.setChecked(self._follow)
        for w in (self.slider, self.follow_check):
            w.blockSignals(False)

    # ---------------------------------------------------------------- head and mode
    def kv_head(self) -> int:
        """The kv head shown (ALL_HEADS = -1: the fraction of heads choosing each page)."""
        data = self.head_combo.currentData()
        return ALL_HEADS if data is None else int(data)

    def set_kv_head(self, h: int) -> None:
        self.head_combo.setCurrentIndex(max(0, self.head_combo.findData(int(h))))

    def set_mode(self, mode: str) -> None:
        self.mode_combo.setCurrentIndex(MODES.index(mode))

    def mode(self) -> str:
        return self.mode_combo.currentData()

    def _sync_heads(self, n: int) -> None:
        if n == self._n_heads:
            return
        keep = self.kv_head() if self._n_heads else 0
        self._n_heads = n
        self.head_combo.blockSignals(True)
        self.head_combo.clear()
        for h in range(n):
            self.head_combo.addItem(f"{h}", h)
        self.head_combo.addItem("all heads", ALL_HEADS)
        self.head_combo.setCurrentIndex(max(0, self.head_combo.findData(keep)))
        self.head_combo.blockSignals(False)

    # ---------------------------------------------------------------- drawing
    def image(self) -> np.ndarray:
        """The uint8 image shown: row i = layers()[i], column j = page id first_page() + j."""
        return self._image.copy()

    def layers(self) -> list[int]:
        return list(self._layers)

    def first_page(self) -> int:
        return self._first

    def _redraw(self) -> None:
        step = self.current_step()
        if step is None:
            self._image, self._layers, self._picks = np.zeros((0, 0), dtype=np.uint8), [], {}
            self.img.clear()
            self.caption.setText("")
            self._stack.setCurrentWidget(self.hint_label)
            return
        self._picks = {(p.layer, p.kv_head): p for p in step.quest}
        self._sync_heads(max(h for _, h in self._picks) + 1)
        self._layers = sorted({layer for layer, _ in self._picks})
        ids = np.concatenate([np.asarray(p.blocks, dtype=np.int64).ravel() for p in step.quest])
        self._first = int(ids.min()) if len(ids) else 0
        width = int(ids.max()) - self._first + 1 if len(ids) else 1
        head, scores = self.kv_head(), self.mode() == "scores"
        heads = range(self._n_heads) if head == ALL_HEADS else [head]
        value = np.zeros((len(self._layers), width))
        for row, layer in enumerate(self._layers):
            for h in heads:
                p = self._picks.get((layer, h))
                if p is None or not len(p.blocks):
                    continue
                x = np.asarray(p.blocks, dtype=np.int64).ravel() - self._first
                v = np.ones(len(x))
                if scores:
                    s = np.nan_to_num(np.asarray(p.scores, dtype=np.float64).ravel(), posinf=0.0, neginf=0.0)
                    span = s.max() - s.min()
                    v = LOW + (1 - LOW) * ((s - s.min()) / span if span > 0 else np.ones(len(s)))
                value[row, x] += v / len(heads)
        self._image = np.clip(np.round(value * 255), 0, 255).astype(np.uint8)
        self.img.setImage(self._image, autoLevels=False, levels=(0, 255))
        self.img.setRect(QRectF(self._first - 0.5, -0.5, width, len(self._layers)))
        self.viewbox.setRange(xRange=(self._first - 0.5, self._first + width - 0.5),
                              yRange=(-0.5, len(self._layers) - 0.5), padding=0)
        every = max(1, len(self._layers) // 8)
        self.plot.getPlotItem().getAxis("left").setTicks(
            [[(i, str(layer)) for i, layer in enumerate(self._layers) if i % every == 0],
             [(i, str(layer)) for i, layer in enumerate(self._layers) if i % every]])
        self.caption.setText(self._caption(step))
        self._stack.setCurrentIndex(0)

    def recall(self) -> dict[int, float]:
        """Layer -> the recall of the shown step's picks (the attention mass on the pages they loaded, measured
        at the next step and averaged over the query heads); empty when not measured or not known yet."""
        i = self._index
        if not (0 <= i < len(self._steps) - 1) or self._steps[i + 1].step != self._steps[i].step + 1:
            return {}
        m = self._steps[i + 1].metrics
        return {layer: m[f"quest_recall_l{layer}"] for layer in self._layers if f"quest_recall_l{layer}" in m}

    def _caption(self, step: StepTrace) -> str:
        head = self.kv_head()
        picks = [p for p in step.quest if head == ALL_HEADS or p.kv_head == head]
        chosen = sorted({len(p.blocks) for p in picks})
        cands = sorted({p.n_blocks for p in picks})
        sel = f"{chosen[0]}" if len(chosen) == 1 else f"{chosen[0]}-{chosen[-1]}"
        cand = f"{cands[0]}" if len(cands) == 1 else f"{cands[0]}-{cands[-1]}"
        frac = fmt_pct(np.mean([len(p.blocks) / p.n_blocks for p in picks if p.n_blocks])) if picks else "—"
        layers = self._layers
        who = "all heads" if head == ALL_HEADS else f"kv head {head}"
        text = (f"step {step.step} ({self._index + 1}/{len(self._steps)}) · {len(layers)} layers "
                f"({layers[0]}-{layers[-1]}) · {who} · {sel} / {cand} pages per layer ({frac} budget) · "
                "loaded at the next step")
        recall = self.recall()
        if recall:
            low = min(recall, key=recall.get)
            text += (f" · recall {fmt_pct(np.mean(list(recall.values())))} (all heads; lowest: layer {low}, "
                     f"{fmt_pct(recall[low])})")
        return text

    # ---------------------------------------------------------------- hover
    def tooltip_at(self, x: float, y: float) -> str:
        row, page = int(round(y)), int(round(x))
        if not (0 <= row < len(self._layers)) or not (0 <= page - self._first < self._image.shape[1]):
            return ""
        layer, head = self._layers[row], self.kv_head()
        heads = range(self._n_heads) if head == ALL_HEADS else [head]
        lines = [f"layer {layer} · page {page}"]
        recall = self.recall()
        if layer in recall:
            lines[0] += f" · recall {fmt_pct(recall[layer])}"
        for h in heads:
            p = self._picks.get((layer, h))
            hit = np.nonzero(np.asarray(p.blocks).ravel() == page)[0] if p is not None else []
            state = f"score {float(np.asarray(p.scores).ravel()[hit[0]]):.3g}" if len(hit) else "not selected"
            lines.append(f"head {h}: {state}")
        return "\n".join(lines)
