"""Sparse prefill masks: which (query, key) pairs MInference or XAttention computed in one layer of a prefill.

One uint8 `ImageItem` (fixed levels, a lookup table from the background to the mask colour): rows = query
positions (top to bottom), columns = key positions, binned to at most 256 x 256 token ranges (widgets/
mask_pattern.py). A cell's colour is the share of its causal pairs that were computed (any computed pair shows at
least LOW, so a lone vertical line stays visible); the upper triangle is never computed and stays empty, and so do
the rows of prompt tokens that came from the prefix cache. One query head, or the mean of the heads. At the
mask's right, beyond a splitter, a small layers × heads grid gives each head's recorded density (click a cell to
show that layer and head); it keeps the room its axes and cells need, so it always fits in the view (the window's
minimum size counts it, and the caption's wrapped lines). The newest prefill with masks is shown; a chooser goes
back to earlier ones. The caption and the hover texts are worded in widgets/mask_text.py.

Binning a mask takes ~15 ms per head (the mean of the heads: all of them), so with `threaded=True` (the app) it
runs on a background thread: the view asks for the cells it shows, keeps drawing the previous picture meanwhile
and redraws when they arrive (`is_binning()`). Without it (tests of the pictures), it bins inline.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget

from engine.trace.events import PREFILL
from widgets.heatmap_view import HeatmapView
from widgets.mask_pattern import MEAN_HEADS, PrefillMasks, bin_edges
from widgets.mask_text import caption, cell_text, grid_cell_text
from widgets.trace_common import KIND_COLORS, apply_heatmap_palette, show_hover

NO_MASKS_HINT = ("no sparse prefill masks: choose MInference or XAttention and send a prompt longer than the "
                 "policy's dense-below length")
MASK_COLOR = KIND_COLORS["attention"]
MAX_PREFILLS = 8     # masks of a long prompt are large (MInference: ~7K ints per head and layer)
LOW = 0.25           # a cell with any computed pair shows at least this much colour
GRID_MIN_W, GRID_MIN_H = 160, 120   # the density grid: room for its axes and cells of a few pixels


class MaskView(HeatmapView):
    """API: `set_steps(steps)`, `append_steps(steps)` (prefill steps with masks; the last `max_prefills` kept),
    `clear()`, `set_prefill_index(i)`, `set_layer(layer)`, `set_head(h)` (MEAN_HEADS = -1 for the mean of the
    heads); read back `image()` (the uint8 array shown, row i = query tokens edges()[i]..edges()[i+1]-1, column j
    likewise for keys), `fractions()` (each cell's share of computed pairs), `current()` (the PrefillMasks shown),
    `layer()`, `head()`, `layer_densities()`, `prefill_count()`, `showing_hint()`, `caption.text()`,
    `tooltip_at(x, y)` (x = key position, y = query position), `head_densities()` (the grid, [layers, heads]),
    `grid_tooltip_at(layer, head)`, `is_binning()`."""

    _binned = Signal(object, object, object)   # (cache key, its PrefillMasks, (kept, causal)) from the binning thread

    def __init__(self, max_prefills: int = MAX_PREFILLS, threaded: bool = False, parent: QWidget | None = None):
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvscope-masks") if threaded else None
        self._asked: set = set()          # cache keys being binned
        self._binned.connect(self._on_binned)
        self._prefills: deque[PrefillMasks] = deque(maxlen=max_prefills)
        self._index = -1
        self._image = np.zeros((0, 0), dtype=np.uint8)
        self._fractions = np.zeros((0, 0))
        self._edges = np.zeros(1, dtype=np.int64)
        self._cache: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._dense: str | dict | None = None   # set_dense_reasons

        self.prefill_combo = QComboBox(toolTip="The recorded prefill whose masks are shown (newest last)")
        self.layer_combo = QComboBox(toolTip="The layer whose mask is shown (or click its bar below)")
        self.head_combo = QComboBox(toolTip="The query head whose mask is shown, or the mean of the heads")
        self._heatmap("key position", "query position", "masks")   # the first query on top; not aspect-locked:
                                                                   # a flat dock would shrink a square mask
        self.grid = pg.PlotWidget()            # density per head: layers (x) × heads (y, the first on top)
        self.grid.hideButtons()
        self.side_min = (GRID_MIN_W, GRID_MIN_H)
        self.grid.setMouseEnabled(x=False, y=False)
        grid_item = self.grid.getPlotItem()
        grid_item.setLabel("left", "head")
        grid_item.setLabel("bottom", "layer")
        grid_item.setTitle("density per head", size="9pt")
        grid_item.layout.setContentsMargins(1, 1, 8, 1)   # the last layer's column and label clear the edge
        grid_item.getViewBox().invertY(True)
        self.grid_img = pg.ImageItem(axisOrder="row-major")
        self.grid_img.setLevels([0, 255])
        self.grid.addItem(self.grid_img)
        self.grid_mark = pg.PlotDataItem(pen=pg.mkPen(width=2))   # the layer and head shown
        self.grid.addItem(self.grid_mark)
        self._grid = np.zeros((0, 0))

        controls = QHBoxLayout()
        for label, combo in (("prefill", self.prefill_combo), ("layer", self.layer_combo),
                             ("head", self.head_combo)):
            controls.addWidget(QLabel(label))
            controls.addWidget(combo)
        controls.addStretch(1)
        self._layout(controls, hint=NO_MASKS_HINT, side=self.grid)

        self.prefill_combo.currentIndexChanged.connect(self._on_prefill_chosen)
        self.layer_combo.currentIndexChanged.connect(lambda *_: self._redraw())
        self.head_combo.currentIndexChanged.connect(lambda *_: self._redraw())
        self.grid.scene().sigMouseClicked.connect(self._on_grid_clicked)
        self.grid.scene().sigMouseMoved.connect(self._on_grid_hover)
        self._apply_palette()

    # ---------------------------------------------------------------- palette
    def _apply_palette(self) -> None:
        """Background and axes from the palette; the lookup tables run from the background to MASK_COLOR."""
        apply_heatmap_palette(self, (self.plot, self.grid), self.img, MASK_COLOR)
        apply_heatmap_palette(self, (), self.grid_img, MASK_COLOR)
        self.grid_mark.setPen(pg.mkPen(self.palette().color(self.foregroundRole()), width=2))
        self._draw_grid()

    # ---------------------------------------------------------------- history
    def set_steps(self, steps) -> None:
        """Show these steps' masks (prefill steps with masks only), replacing what was shown; newest selected."""
        self._prefills.clear()
        self._cache.clear()
        self._prefills.extend(p for p in map(self._masks_of, steps) if p is not None)
        self._index = len(self._prefills) - 1
        self._sync_prefills()
        self._redraw()

    def append_steps(self, steps) -> None:
        """Add new steps (oldest first); a new prefill with masks is shown when the newest one was."""
        new = [p for p in map(self._masks_of, steps) if p is not None]
        if not new:
            return
        shown = self.current()
        follow = shown is None or self._index == len(self._prefills) - 1
        self._prefills.extend(new)
        kept = {id(p) for p in self._prefills}
        self._cache = {k: v for k, v in self._cache.items() if k[0] in kept}
        self._index = next((i for i, p in enumerate(self._prefills) if p is shown and not follow),
                           len(self._prefills) - 1)
        self._sync_prefills()
        self._redraw()

    @staticmethod
    def _masks_of(step) -> PrefillMasks | None:
        return PrefillMasks.from_step(step) if step.phase == PREFILL and step.masks else None

    def clear(self) -> None:
        self._prefills.clear()
        self._cache.clear()
        self._index = -1
        self._sync_prefills()
        self._redraw()

    def set_dense_reasons(self, reasons: str | dict | None) -> None:
        """Why the last prefill ran dense, from its policy's stats: a string when no layer ran sparse (`reason`),
        {layer: why} for the layers that did not (`dense_layers`); None: none did. Said where its masks would be
        (the hint, or the caption of the prefill shown): no mask is drawn for work that was not done that way."""
        self._dense = reasons
        self.hint_label.setText(f"no masks: the last prefill ran dense ({reasons})" if isinstance(reasons, str)
                                else NO_MASKS_HINT)
        self._redraw()

    def prefill_count(self) -> int:
        return len(self._prefills)

    def current(self) -> PrefillMasks | None:
        return self._prefills[self._index] if 0 <= self._index < len(self._prefills) else None

    def set_prefill_index(self, i: int) -> None:
        """Show the i-th recorded prefill with masks (negative counts from the newest)."""
        if self._prefills:
            self.prefill_combo.setCurrentIndex(max(0, min(len(self._prefills) - 1, i % len(self._prefills))))

    def _on_prefill_chosen(self, i: int) -> None:
        if 0 <= i < len(self._prefills) and i != self._index:
            self._index = i
            self._redraw()

    def _sync_prefills(self) -> None:
        combo = self.prefill_combo
        combo.blockSignals(True)
        combo.clear()
        for p in self._prefills:
            combo.addItem(f"step {p.step} · {p.n:,} tokens")
        combo.setCurrentIndex(self._index)
        combo.blockSignals(False)

    # ---------------------------------------------------------------- layer and head
    def layer(self) -> int:
        data = self.layer_combo.currentData()
        return -1 if data is None else int(data)

    def set_layer(self, layer: int) -> None:
        i = self.layer_combo.findData(int(layer))
        if i >= 0:
            self.layer_combo.setCurrentIndex(i)

    def head(self) -> int:
        """The query head shown (MEAN_HEADS = -1: the mean of the heads)."""
        data = self.head_combo.currentData()
        return MEAN_HEADS if data is None else int(data)

    def set_head(self, h: int) -> None:
        i = self.head_combo.findData(int(h))
        if i >= 0:
            self.head_combo.setCurrentIndex(i)

    def _sync_choices(self, p: PrefillMasks) -> None:
        """Layers and heads of the prefill shown, keeping the chosen ones where it has them."""
        layer, head = self.layer(), self.head() if self.head_combo.count() else 0
        for combo, items, keep in ((self.layer_combo, [(str(x), x) for x in p.layers], layer),
                                   (self.head_combo, [(str(h), h) for h in range(p.n_heads)]
                                    + [("mean of heads", MEAN_HEADS)], head)):
            combo.blockSignals(True)
            if [combo.itemData(i) for i in range(combo.count())] != [d for _, d in items]:
                combo.clear()
                for text, data in items:
                    combo.addItem(text, data)
            combo.setCurrentIndex(max(0, combo.findData(keep)))
            combo.blockSignals(False)

    # ---------------------------------------------------------------- drawing
    def image(self) -> np.ndarray:
        """The uint8 image shown: rows = query token bins, columns = key token bins (`edges()`)."""
        return self._image.copy()

    def fractions(self) -> np.ndarray:
        """Each cell's share of its causal pairs that were computed (0 where it has none)."""
        return self._fractions.copy()

    def edges(self) -> np.ndarray:
        """Token boundaries of the bins (the same for rows and columns): bin i is edges[i] .. edges[i+1]-1."""
        return self._edges.copy()

    def layer_densities(self) -> dict[int, float]:
        """Mean density over the heads of each layer of the prefill shown."""
        p = self.current()
        return {} if p is None else {layer: p.layer_density(layer) for layer in p.layers}

    def head_densities(self) -> np.ndarray:
        """The grid: [layers of the prefill shown, heads] recorded densities (nan where a head was not recorded)."""
        p = self.current()
        if p is None:
            return np.zeros((0, 0))
        return np.array([[p.masks[(layer, h)].density if (layer, h) in p.masks else np.nan
                          for h in range(p.n_heads)] for layer in p.layers], dtype=np.float64).reshape(
                              len(p.layers), p.n_heads)

    def is_binning(self) -> bool:
        """Whether the picture asked for is still being binned (threaded only)."""
        return bool(self._asked)

    def _cells(self, p: PrefillMasks, layer: int, head: int):
        """The (kept, causal) cells shown; threaded, None until they arrive (the view redraws then)."""
        key = (id(p), layer, head)
        if key in self._cache:
            return self._cache[key]
        if self._pool is None:
            self._cache[key] = p.cells(layer, head, self._edges)
            return self._cache[key]
        if key not in self._asked:
            self._asked.add(key)
            self._pool.submit(self._bin, key, p, layer, head, self._edges)
        return None

    def _bin(self, key, p: PrefillMasks, layer: int, head: int, edges: np.ndarray) -> None:
        """On the binning thread: the cells, sent back to the GUI thread by a queued signal."""
        cells = p.cells(layer, head, edges)
        try:
            self._binned.emit(key, p, cells)
        except RuntimeError:      # the view is gone
            pass

    def _on_binned(self, key, masks: PrefillMasks, cells) -> None:
        self._asked.discard(key)
        if any(p is masks for p in self._prefills):          # still held (the job kept it alive: ids stay unique)
            self._cache[key] = cells
            p = self.current()
            if p is not None and key == (id(p), self.layer(), self.head()):
                self._redraw()

    def _redraw(self) -> None:
        p = self.current()
        if p is None:
            self._image, self._fractions = np.zeros((0, 0), dtype=np.uint8), np.zeros((0, 0))
            self.img.clear()
            self.caption.setText("")
            self._fit_caption()
            self._draw_grid()
            self._stack.setCurrentWidget(self.hint_label)
            return
        self._sync_choices(p)
        self._edges = bin_edges(p.n)
        self._draw_grid()
        self._stack.setCurrentIndex(0)
        cells = self._cells(p, self.layer(), self.head())
        if cells is None:                                   # being binned: the previous picture stays meanwhile
            self.caption.setText(self._caption(p) + " · binning…")
            self._fit_caption()
            return
        kept, causal = cells
        self._fractions = np.divide(kept, causal, out=np.zeros_like(kept, dtype=float), where=causal > 0)
        shown = np.where(kept > 0, LOW + (1 - LOW) * self._fractions, 0.0)
        self._image = np.clip(np.round(shown * 255), 0, 255).astype(np.uint8)
        self.img.setImage(self._image, autoLevels=False, levels=(0, 255))
        self.img.setRect(QRectF(0, 0, p.n, p.n))
        self.viewbox.setRange(xRange=(0, p.n), yRange=(0, p.n), padding=0)
        self.caption.setText(self._caption(p))
        self._fit_caption()

    def _caption(self, p: PrefillMasks) -> str:
        return caption(p, self.layer(), self.head(), self._dense, p is self._prefills[-1])

    def _draw_grid(self) -> None:
        """The layers × heads density grid, with the layer and head shown outlined (the whole column for the mean)."""
        p, grid = self.current(), self.head_densities()
        if p is None or not grid.size:
            self.grid_img.clear()
            self.grid_mark.setData([], [])
            self._fit_side()
            return
        self.grid_img.setImage(np.round(np.nan_to_num(grid.T) * 255).astype(np.uint8), autoLevels=False,
                               levels=(0, 255))
        self.grid_img.setRect(QRectF(-0.5, -0.5, len(p.layers), p.n_heads))
        self.grid.setXRange(-0.5, len(p.layers) - 0.5, padding=0)
        self.grid.setYRange(-0.5, p.n_heads - 0.5, padding=0)
        every = max(1, -(-len(p.layers) // 4))                 # a narrow grid: about four labels
        self.grid.getPlotItem().getAxis("bottom").setTicks(
            [[(i, str(layer)) for i, layer in enumerate(p.layers) if i % every == 0], []])
        x = p.layers.index(self.layer()) if self.layer() in p.layers else 0
        y0, y1 = (-0.5, p.n_heads - 0.5) if self.head() == MEAN_HEADS else (self.head() - 0.5, self.head() + 0.5)
        self.grid_mark.setData([x - 0.5, x + 0.5, x + 0.5, x - 0.5, x - 0.5], [y0, y0, y1, y1, y0])
        self._fit_side()

    def _grid_cell(self, scene_pos) -> tuple[int, int] | None:
        """(layer, head) of the grid cell under a scene position, or None."""
        p, vb = self.current(), self.grid.getPlotItem().getViewBox()
        if p is None or not vb.sceneBoundingRect().contains(scene_pos):
            return None
        pt = vb.mapSceneToView(scene_pos)
        i, h = int(round(pt.x())), int(round(pt.y()))
        return (p.layers[i], h) if 0 <= i < len(p.layers) and 0 <= h < p.n_heads else None

    def _on_grid_clicked(self, event) -> None:
        cell = self._grid_cell(event.scenePos())
        if cell is not None:
            self.set_layer(cell[0])
            self.set_head(cell[1])

    def grid_tooltip_at(self, layer: int, head: int) -> str:
        p = self.current()
        return "" if p is None else grid_cell_text(p, layer, head)

    def _on_grid_hover(self, scene_pos) -> None:
        cell = self._grid_cell(scene_pos)
        show_hover(self.grid, self.grid.getPlotItem().getViewBox(), scene_pos,
                   lambda *_: "" if cell is None else self.grid_tooltip_at(*cell))

    # ---------------------------------------------------------------- hover
    def tooltip_at(self, x: float, y: float) -> str:
        """What the cell under (key x, query y) holds: its token ranges and its share of computed pairs."""
        p = self.current()
        if p is None or not (0 <= x < p.n and 0 <= y < p.n):
            return ""
        if self.is_binning():
            return "binning the mask…"
        return cell_text(p, self.layer(), self.head(), self._edges, self._fractions, x, y)
