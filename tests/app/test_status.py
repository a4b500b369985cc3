"""The status bar's progress: its ETA, and a bar that appears only for a task that lasts."""
from __future__ import annotations

import pytest

from app.status import EtaEstimator, StatusBar, format_eta


def test_eta_from_the_progress_rate():
    eta = EtaEstimator()
    assert eta.update("prefill", 0.1, now=100.0) is None          # the first report only starts the clock
    assert eta.update("prefill", 0.3, now=102.0) == pytest.approx(7.0)   # 0.2 in 2 s: 0.7 left takes 7 s
    assert eta.update("prefill", 0.05, now=103.0) is None         # went back: the next task
    assert eta.update("model", 0.5, now=104.0) is None            # another task
    assert format_eta(7.2) == "7 s" and format_eta(95) == "1 min 35 s" and format_eta(None) == ""


def test_the_bar_appears_only_for_a_task_that_lasts_and_shows_its_newest_report(qtbot):
    t = [100.0]
    bar = StatusBar(clock=lambda: t[0])
    qtbot.addWidget(bar)
    bar.show()
    bar.show_progress("prefill", 0.1, "prefill: 3 of 30 layers")     # a question about a cached document:
    t[0] = 100.05
    bar.show_progress("prefill", 0.5, "prefill: 15 of 30 layers")
    assert bar.progress_text() == ""
    bar.hide_progress()                                                # its answer came: no bar, then or later
    qtbot.wait(int(1000 * StatusBar.SHOW_AFTER_S) + 100)
    assert bar.progress_text() == ""

    t[0] = 200.0                                                       # a long task: one report, then silence
    bar.show_progress("model", 0.1, "reading weights")
    assert bar.progress_text() == ""
    t[0] = 200.35
    qtbot.waitUntil(lambda: bar.progress_text() == "reading weights — 10%", timeout=2000)   # (a timer shows it)
    t[0] = 200.36                                                      # reports within UPDATE_EVERY_S of the draw
    bar.show_progress("model", 0.2, "converting")
    t[0] = 200.37
    bar.show_progress("model", 0.3, "warming up")
    assert bar.progress_text() == "reading weights — 10%"
    qtbot.waitUntil(lambda: bar.progress_text().startswith("warming up — 30%"), timeout=2000)   # the newest
    bar.show_progress("model", 1.0, "ready")
    assert bar.progress_text() == "" and not bar.progress.isVisible()
