"""The window's telemetry pump: drains the engine's steps on a ~30 Hz timer, draws each view once per tick, and
measures itself (how often it drew, how long a draw took, the share of the GUI thread it used).

The engine never waits for the GUI: steps go into the worker's bounded deque (app/worker.py) and are drained here.
Drawing costs CPU (and the GIL) that an engine on the CPU needs: on a 2-core machine, redrawing the views after
every decode step took ~20-30% of a core and slowed decode by ~30%. So the pump holds the GUI thread under a
budget (`set_budget`: the share of one core it may use): about once a second it compares the GUI thread's CPU
time with the budget and halves or doubles the time between draws (33 ms .. 2 s: at 1 s a
watched layerwise turn on a 2-core CPU still used 8-10% of a core), over windows in which steps
arrived only (a GPU turn lasts about a second: an interval relaxed while the window idled between turns made every
turn start drawing at 30 Hz, the GUI thread 22-25% busy during layerwise turns on an H100). Steps are coalesced meanwhile,
never dropped; `flush()` draws at once (the end of an answer). Under a budget the timer itself ticks only at half the
draw interval: each tick wakes the GUI thread, and on a 2-core CPU every wake-up takes a time slice from the engine.
With nothing arriving for IDLE_S (between turns, or a turn not watched) it ticks every IDLE_TICK_MS whatever the
budget, until steps come again or `wake()` (a request begins): an idle window on the 2-core CPU woke 13-21 times a
second and took 9-11 ms of a core each second, ~0.3-0.5 ms a wake-up (Qt's and PySide's dispatch around a callback of
~0.07 ms).
"""
from __future__ import annotations

import os
import time
from collections import deque

from PySide6.QtCore import QObject, QTimer

TICK_MS = 33            # ~30 Hz
MAX_INTERVAL_MS = 2000  # the slowest the views are redrawn while steps arrive
ADJUST_S = 1.0          # how often the draw interval is adapted to the budget
MAX_TICK_MS = 500       # under a budget the timer ticks at half the draw interval, up to this (each tick wakes the
#                         GUI thread: 30 a second took a core's time slices from a CPU engine for nothing to draw)
IDLE_S = 2.0            # no steps for this long: the pump idles ...
IDLE_TICK_MS = 500      # ... and ticks this often until steps come or `wake()`


TIGHT_BUDGET = 0.05     # the GUI's share of a core where the engine's decode is a host loop on a GPU host
CPU_BUDGET = 0.015      # ... and where the engine computes on every core of a CPU: each ms the window's process ran
#                         there cost the engine up to ~2 ms (one thread of its team preempted, the other waits for it
#                         at the next barrier). 2-core CPU, default model, tools/app_overhead.py (32-token turns): at
#                         0.05 the app decoded at 0.93-0.95x the engine alone (1.5-2.7 draws/s), at 0.025 0.94-0.95x,
#                         at 0.015 0.95-0.97x (0.6-0.8 draws/s; every step still drawn, at the latest when the answer ends)
TIGHT_RENDER_MS = 250   # ... and how often the streaming answer is re-rendered then


def gui_budget(device: str, engine_threads: int, mode: str = "gpu", cores: int | None = None) -> float:
    """The GUI thread's budget: tight when the engine computes on the CPU with a thread on every core (the GUI
    would take time from it), and on a GPU in the offload modes, whose decode steps are host loops in Python (per
    layer: waits, copies, graph replays, loads), bound by one host core's speed. Sharing the GIL was the first
    reason (engine thread, H100, default model: layerwise 298 tok/s alone, 120 with the window drawing). With the
    engine in a process of its own (app/engine_process.py) the window drawing at its full rate (~8 draws/s, its
    GUI thread 30% busy) still cost layerwise 19-25% and chunked 27-30%, while the tight budget costs nothing
    measurable (tools/app_overhead.py, 8-10 interleaved rounds): other work on the host slows that one core (a
    CPU-burning process alone slowed chunked decode 0.81-0.83x, in bimodal turns: tools/host_load.py). No limit
    where the engine leaves a core free or runs gpu mode (one graph replay per step). A CPU engine on every core
    gets the tightest (CPU_BUDGET)."""
    cores = cores or os.cpu_count() or 1
    if device.startswith("cpu"):
        return CPU_BUDGET if engine_threads >= cores else 1.0
    return TIGHT_BUDGET if mode in ("layerwise", "chunked") else 1.0


class TelemetryPump(QObject):
    """`views` need `append_steps(steps)` and `clear()`; `on_steps(steps, recent)` does the rest of a tick's
    drawing (metrics, status). `stats()` -> the refresh figures since `reset_stats()`."""

    def __init__(self, drain, views, on_steps, on_restart, interval_ms: int = TICK_MS, parent=None):
        super().__init__(parent)
        self._drain, self._views, self._on_steps, self._on_restart = drain, views, on_steps, on_restart
        self.recent: deque = deque(maxlen=64)   # steps for the metrics strip
        self._last_step = -1                    # number of the newest step drawn
        self.budget = 1.0                       # share of a core the GUI thread may use (1.0: no limit)
        self._tick_ms = interval_ms             # the timer's interval without a budget
        self.interval_ms = float(interval_ms)   # the time between draws, adapted to the budget
        self._pending: list = []                # drained, not drawn yet
        self._arrived = False                   # steps came in the budget's current window
        self._last_draw = 0.0
        self._window = (time.perf_counter(), time.thread_time())
        self._quiet_since = self._window[0]     # when steps last arrived
        self.idle = False                       # ticking every IDLE_TICK_MS (nothing arrived for IDLE_S)
        self.timer = QTimer(self, interval=interval_ms)
        self.timer.timeout.connect(self.tick)
        self.reset_stats()

    def set_budget(self, share: float) -> None:
        """The share of one core the GUI thread may use while steps arrive (1.0 = draw at every tick)."""
        self.budget = share
        if share >= 1.0:
            self.interval_ms = float(self._tick_ms)
        self._retime()

    def _retime(self) -> None:
        """The timer's interval: the tick, or under a budget half the draw interval (at most MAX_TICK_MS); idle,
        IDLE_TICK_MS."""
        tick = (IDLE_TICK_MS if self.idle else self._tick_ms if self.budget >= 1.0 else
                int(min(MAX_TICK_MS, max(self._tick_ms, self.interval_ms / 2))))
        if tick != self.timer.interval():
            self.timer.setInterval(tick)

    def wake(self) -> None:
        """A request begins: tick at the working rate again, so that its first steps are drawn without waiting out
        an idle tick."""
        self._quiet_since = time.perf_counter()
        if self.idle:
            self.idle = False
            self._retime()

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def reset_stats(self) -> None:
        self._t0, self._cpu0 = time.perf_counter(), time.thread_time()   # (reset from the GUI thread)
        self._draw_s: list[float] = []
        self._steps_drawn = 0

    def stats(self) -> dict:
        """draws/s, steps drawn, draw time (median and p95, ms), the GUI thread's share of the wall time spent in
        the pump's drawing (`draw_share`) and in everything it ran (`gui_cpu_share`: painting, layout, the chat's
        Markdown, ...; call from the GUI thread)."""
        wall = max(1e-9, time.perf_counter() - self._t0)
        d = sorted(self._draw_s)
        pick = (lambda q: 1e3 * d[min(len(d) - 1, int(q * len(d)))]) if d else (lambda q: 0.0)
        return {"seconds": wall, "draws": len(d), "draws_per_s": len(d) / wall, "steps": self._steps_drawn,
                "interval_ms": self.interval_ms, "budget": self.budget,
                "draw_ms_median": pick(0.5), "draw_ms_p95": pick(0.95), "draw_share": sum(d) / wall,
                "gui_cpu_share": (time.thread_time() - self._cpu0) / wall}

    def tick(self) -> None:
        """Drain the steps recorded since the last tick; draw them when the draw interval has passed."""
        new = self._drain()
        self._pending += new
        self._arrived = self._arrived or bool(new)
        now = time.perf_counter()
        if new:
            self.wake()
        elif not self.idle and not self._pending and now - self._quiet_since >= IDLE_S:
            self.idle = True
            self._retime()
        self._adapt(now)
        if self._pending and (now - self._last_draw) * 1e3 >= self.interval_ms - self.timer.interval() / 2:
            self.flush()

    def _adapt(self, now: float) -> None:
        t0, cpu0 = self._window
        if now - t0 < max(ADJUST_S, 2 * self.interval_ms / 1e3) or self.budget >= 1.0:   # a window holds draws
            return
        share = (time.thread_time() - cpu0) / (now - t0)
        arrived, self._arrived = self._arrived, False
        if not arrived:       # idle between turns: the interval learned while steps came is kept for the next turn
            self._window = (now, time.thread_time())
            return
        if share > self.budget:
            self.interval_ms = min(MAX_INTERVAL_MS, self.interval_ms * 2)
        elif share < self.budget / 3:
            self.interval_ms = max(self._tick_ms, self.interval_ms / 2)
        self._window = (now, time.thread_time())
        self._retime()

    def flush(self) -> None:
        """Draw every step drained so far (each view once).

        A reloaded engine's recorder counts steps from 0 again on its own clock: from its first step on, the views
        start over (the old engine's steps drained before it are dropped with them)."""
        steps, self._pending = self._pending + self._drain(), []
        if not steps:
            return
        t = self._last_draw = time.perf_counter()
        numbers = [self._last_step] + [s.step for s in steps]
        restart = max((i for i in range(len(steps)) if numbers[i + 1] <= numbers[i]), default=None)
        if restart is not None:
            steps = steps[restart:]
            for view in self._views:
                view.clear()
            self.recent.clear()
            self._on_restart()
        self._last_step = steps[-1].step
        self.recent.extend(steps)
        for view in self._views:
            view.append_steps(steps)
        self._on_steps(steps, self.recent)
        self._draw_s.append(time.perf_counter() - t)
        self._steps_drawn += len(steps)
