"""Ring buffer occupancy: what each GPU ring slot held, and in which state, over time.

One row per ring slot. Each `SlotState` record lasts until the next record of the same slot (the last one until
the end of the newest step) and is drawn twice: a faint full-height band in the state's colour, and a solid bar
from the bottom whose height is the fill fraction (tokens / capacity). One `BarGraphItem` per colour. A table
beside the plot lists each slot's latest layer, state and fill. Ring slots exist only in the offload modes;
without any, a centred hint says so.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QStackedLayout, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from engine.trace.events import SLOT_STATES, SlotState, StepTrace
from widgets.trace_common import DEFAULT_MAX_STEPS, STATE_COLORS, TracePlot, fmt_us

GPU_MODE_HINT = "no ring: gpu mode keeps KV on the device"
TRACK_MIX = 0.3          # the faint state band behind the fill bar: this much state colour over the background
MIN_FILL = 0.06          # an empty slot still shows a sliver of its state's colour


def _empty() -> dict[str, np.ndarray]:
    return {k: np.zeros(0) for k in ("t", "slot", "state", "layer", "tokens", "capacity")}


class RingView(TracePlot):
    """Ring slot occupancy. API: `set_steps(steps)`, `append_step(step)` (the last `max_steps` are kept),
    `clear()`, `set_mode(mode)` (words the hint for the engine's mode); read back `slots()`, `latest_slots()`
    (slot -> its last SlotState), `slot_layers()` (slot -> layer), `showing_hint()` and `table`."""

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS, parent: QWidget | None = None):
        super().__init__([], max_steps, "ring", parent)
        self._intervals = _empty() | {"t1": np.zeros(0), "row": np.zeros(0)}
        self._slots: list[int] = []
        self._tracks: dict[str, pg.BarGraphItem] = {}
        self._fills: dict[str, pg.BarGraphItem] = {}
        for state in SLOT_STATES:
            self._tracks[state] = pg.BarGraphItem(x0=[], x1=[], y0=[], height=[], brush=STATE_COLORS[state],
                                                  pen=pg.mkPen(None))
            self._fills[state] = pg.BarGraphItem(x0=[], x1=[], y0=[], height=[], brush=STATE_COLORS[state],
                                                 pen=pg.mkPen(STATE_COLORS[state], width=1))
            self.plot.addItem(self._tracks[state])
            self.plot.addItem(self._fills[state])

        self.table = QTableWidget(0, 4)
        self._table_rows: list[tuple] = []      # the cells' texts as last set
        self._drawn: dict[str, np.ndarray] = {}  # state -> its bars as last set (x0, x1, row, fill)
        self.table.setHorizontalHeaderLabels(["slot", "layer", "state", "fill"])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.setMaximumWidth(230)
        legend = QLabel("  ".join(f'<span style="color:{STATE_COLORS[s]}">■</span> {s}' for s in SLOT_STATES)
                        + "  (bar height: tokens / capacity)")
        legend.setTextFormat(Qt.TextFormat.RichText)

        content = QWidget()
        row = QHBoxLayout()
        row.addWidget(self.plot, 1)
        row.addWidget(self.table)
        inner = QVBoxLayout(content)
        inner.setContentsMargins(0, 0, 0, 0)
        inner.addWidget(legend)
        inner.addLayout(row, 1)
        self.hint_label = QLabel(GPU_MODE_HINT, alignment=Qt.AlignmentFlag.AlignCenter)
        self.hint_label.setWordWrap(True)
        self._stack = QStackedLayout(self)
        self._stack.addWidget(content)
        self._stack.addWidget(self.hint_label)
        self._stack.setCurrentWidget(self.hint_label)
        self._apply_palette()

    def _apply_palette(self) -> None:
        """Also the state bands: opaque blends of the state colour and the background (translucent ones would cost
        a blend per rectangle, several times slower to paint with thousands of them)."""
        super()._apply_palette()
        bg = self.palette().color(QPalette.ColorRole.Base)
        for state, item in getattr(self, "_tracks", {}).items():   # (a palette change may come before __init__ ends)
            c = QColor(STATE_COLORS[state])
            mix = [round(TRACK_MIX * a + (1 - TRACK_MIX) * b) for a, b in
                   ((c.red(), bg.red()), (c.green(), bg.green()), (c.blue(), bg.blue()))]
            item.setOpts(brush=QColor(*mix))

    def set_mode(self, mode: str | None) -> None:
        """Word the hint shown without ring slots for the engine's mode ("gpu", "layerwise", "chunked")."""
        if mode in (None, "gpu"):
            self.hint_label.setText(GPU_MODE_HINT)
        else:
            self.hint_label.setText(f"no ring slot states recorded yet ({mode} mode)")

    def showing_hint(self) -> bool:
        return self._stack.currentWidget() is self.hint_label

    # ---------------------------------------------------------------- drawing data
    def _prepare(self, step: StepTrace) -> dict[str, np.ndarray]:
        if not step.slots:
            return _empty()
        states = {s: i for i, s in enumerate(SLOT_STATES)}
        recs = step.slots
        return {
            "t": np.array([r.t_us for r in recs], dtype=np.float64),
            "slot": np.array([r.slot for r in recs], dtype=np.int64),
            "state": np.array([states.get(r.state, 0) for r in recs], dtype=np.int64),
            "layer": np.array([-1 if r.layer is None else r.layer for r in recs], dtype=np.int64),
            "tokens": np.array([r.tokens for r in recs], dtype=np.float64),
            "capacity": np.array([r.capacity for r in recs], dtype=np.float64),
        }

    def _redraw(self) -> None:
        parts = [data for _, data in self._history if len(data["t"])]
        if parts:
            iv = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        else:
            iv = _empty()
        order = np.lexsort((iv["t"], iv["slot"]))      # by slot, then time
        iv = {k: v[order] for k, v in iv.items()}
        end = max((s.t1_us for s, _ in self._history), default=0.0)
        t1 = np.empty_like(iv["t"])
        if len(t1):
            same_slot_next = iv["slot"][1:] == iv["slot"][:-1]
            t1[:-1] = np.where(same_slot_next, iv["t"][1:], end)
            t1[-1] = end
        slots = sorted({int(s) for s in iv["slot"]})
        iv["t1"] = np.maximum(t1, iv["t"])
        iv["row"] = np.searchsorted(np.asarray(slots, dtype=np.int64), iv["slot"]).astype(np.float64)
        self._intervals = iv
        if slots != self._slots:
            self._slots = slots
            self.set_rows([f"slot {s}" for s in slots])

        frac = np.clip(np.divide(iv["tokens"], iv["capacity"], out=np.zeros_like(iv["tokens"]),
                                 where=iv["capacity"] > 0), 0.0, 1.0)
        fill_h = 0.8 * np.maximum(frac, MIN_FILL)
        x0, x1 = iv["t"] / 1e3, iv["t1"] / 1e3
        for i, state in enumerate(SLOT_STATES):
            m = iv["state"] == i
            bars = np.stack([x0[m], x1[m], iv["row"][m], fill_h[m]])
            if self._drawn.get(state) is not None and np.array_equal(self._drawn[state], bars):
                continue        # (a step without slot states moves only the slots' last intervals' ends)
            self._drawn[state] = bars
            self._tracks[state].setOpts(x0=x0[m], x1=x1[m], y0=iv["row"][m] - 0.4, height=np.full(m.sum(), 0.8))
            self._fills[state].setOpts(x0=x0[m], x1=x1[m], y0=iv["row"][m] + 0.4 - fill_h[m], height=fill_h[m])
        self._fill_table()
        self._stack.setCurrentIndex(0 if slots else 1)

    # ---------------------------------------------------------------- latest state
    def slots(self) -> list[int]:
        """The ring slots shown, one row each (top to bottom)."""
        return list(self._slots)

    def latest_slots(self) -> dict[int, SlotState]:
        """Each slot's most recent state record (steps come one after another: the newest steps are read until
        every slot shown has one, not the whole history at every draw)."""
        latest: dict[int, SlotState] = {}
        for step, _ in reversed(self._history):
            for rec in step.slots:
                if rec.slot not in latest or rec.t_us >= latest[rec.slot].t_us:
                    latest[rec.slot] = rec
            if latest and latest.keys() >= set(self._slots):
                break
        return dict(sorted(latest.items()))

    def slot_layers(self) -> dict[int, int | None]:
        """slot -> the layer it holds now (its latest record)."""
        return {slot: rec.layer for slot, rec in self.latest_slots().items()}

    def _fill_table(self) -> None:
        """The latest state of each slot, one row each; the cells are set only where their text changed (most
        steps at GPU speed carry no slot records: the table then stays as it is, and Qt repaints nothing)."""
        rows = []
        for slot, rec in self.latest_slots().items():
            fill = f"{rec.tokens}/{rec.capacity}" if rec.capacity else str(rec.tokens)
            rows.append((str(slot), "—" if rec.layer is None else str(rec.layer), rec.state, fill))
        if rows == self._table_rows:
            return
        self._table_rows = rows
        self.table.setRowCount(len(rows))
        for row, cells in enumerate(rows):
            for col, text in enumerate(cells):
                item = self.table.item(row, col)
                if item is not None and item.text() == text:
                    continue
                if item is None:
                    item = QTableWidgetItem(text)
                    self.table.setItem(row, col, item)
                else:
                    item.setText(text)
                if col == 2:
                    item.setForeground(QColor(STATE_COLORS.get(text, "#7F7F7F")))

    def table_layers(self) -> dict[int, str]:
        """slot -> the layer cell of the table, as the user reads it."""
        return {int(self.table.item(r, 0).text()): self.table.item(r, 1).text() for r in range(self.table.rowCount())}

    # ---------------------------------------------------------------- hover
    def tooltip_at(self, x_ms: float, y: float) -> str:
        row = self.row_at(y)
        if row is None:
            return ""
        iv, t = self._intervals, x_ms * 1e3
        hit = np.nonzero((iv["row"] == row) & (iv["t"] <= t) & (iv["t1"] >= t))[0]
        if not len(hit):
            return ""
        i = hit[-1]
        layer = "no layer" if iv["layer"][i] < 0 else f"layer {int(iv['layer'][i])}"
        tokens, cap = int(iv["tokens"][i]), int(iv["capacity"][i])
        fill = f"{tokens}/{cap} tokens ({100 * tokens / cap:.0f}%)" if cap else f"{tokens} tokens"
        return (f"slot {int(iv['slot'][i])} · {layer}\n{SLOT_STATES[int(iv['state'][i])]} · {fill}\n"
                f"for {fmt_us(iv['t1'][i] - iv['t'][i])}")
