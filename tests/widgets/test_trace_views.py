"""The trace views on real traces of the engine (tiny default model, CPU): what the user sees in them."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
from PySide6.QtCore import QPointF
from PySide6.QtGui import QColor, QImage, QPalette
from PySide6.QtWidgets import QFileDialog

from widgets.export import add_export_actions, ask_save_path, save_png, save_svg
from widgets.metrics_strip import MetricsStrip
from widgets.ring_view import RingView
from widgets.timeline_view import TimelineView
from widgets.trace_common import KIND_COLORS, STATE_COLORS, contrast_ratio

PROMPT = [list(range(1000, 1100))]


def _trace(model_dir, mode, **kw):
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder

    llm = LLM(str(model_dir), device="cpu", mode=mode, kv_block_size=16, max_model_len=512, torch_threads=1, **kw)
    rec = TraceRecorder()
    llm.recorder = rec
    llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    return list(rec.steps)


@pytest.fixture(scope="module")
def layerwise_steps(default_model_dir):
    return _trace(default_model_dir, "layerwise", ring_slots=2)


@pytest.fixture(scope="module")
def gpu_steps(default_model_dir):
    return _trace(default_model_dir, "gpu")


def _shown(qtbot, widget, w=1000, h=320):
    qtbot.addWidget(widget)
    widget.resize(w, h)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def _zoom_to(view, step):
    view.viewbox.setXRange(step.t0_us / 1e3, step.t1_us / 1e3, padding=0)
    view.refresh_overlays()


def _hover(view, x_ms, y):
    """Move the mouse (as the plot's scene reports it) to a point given in view coordinates."""
    scene_pos = view.viewbox.mapViewToScene(QPointF(x_ms, y))
    view.plot.scene().sigMouseMoved.emit(scene_pos)
    return view.hover_text


# ---------------------------------------------------------------- timeline
def test_timeline_draws_a_bar_for_every_span(qtbot, layerwise_steps):
    view = _shown(qtbot, TimelineView())
    view.set_steps(layerwise_steps)
    spans = [s for step in layerwise_steps for s in step.spans]
    assert view.bar_count() == len(spans)
    for lane in ("compute", "h2d", "d2h", "host"):
        assert view.bar_count(lane) == sum(s.lane == lane for s in spans)
    assert view.bar_count("h2d") > 0 and view.bar_count("compute") > 0

    text = view.summary_label.text()
    assert re.search(r"compute \d+(\.\d)?%", text) and "overlapped by compute" in text and "exposed copy" in text
    assert view.summary.t0_us == pytest.approx(layerwise_steps[0].t0_us)


def test_timeline_summary_and_labels_follow_the_visible_range(qtbot, layerwise_steps):
    view = _shown(qtbot, TimelineView())
    view.set_steps(layerwise_steps)
    last = layerwise_steps[-1]
    _zoom_to(view, last)
    assert view.summary.t0_us == pytest.approx(last.t0_us, abs=1.0)
    assert view.summary.t1_us == pytest.approx(last.t1_us, abs=1.0)
    assert view.summary.busy_fraction["h2d"] > 0           # a decode step of layerwise loads KV
    assert "H2D" in view.summary_label.text() and "GB/s" in view.summary_label.text()
    layer3 = next(s for s in last.spans if s.name == "layer 3")
    pad = layer3.dur_us / 1e3
    view.viewbox.setXRange(layer3.t0_us / 1e3 - pad, layer3.t1_us / 1e3 + pad, padding=0)   # a third of the width
    view.refresh_overlays()
    assert "layer 3" in view.visible_labels()


def test_timeline_says_when_it_shows_some_steps_only(qtbot, default_model_dir):
    """At the app's detail rate a fast decode keeps the timeline of some steps: the view says how many, and its
    busy figures are over those steps' time, not the gaps between them."""
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder

    llm = LLM(str(default_model_dir), device="cpu", mode="layerwise", kv_block_size=16, max_model_len=512,
              torch_threads=1, ring_slots=2)
    llm.recorder = rec = TraceRecorder(detail_hz=1e-9)   # the prefill's timeline and the second decode step's
    llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.close()
    steps = [s for s in rec.steps if s.phase in ("prefill", "decode")]
    view = _shown(qtbot, TimelineView())
    view.set_steps(steps)
    view.fit()
    shown = [steps[0], steps[2]]                         # the prefill and the second decode step
    assert [s.detailed for s in steps] == [True, False, True] + [False] * (len(steps) - 3)
    assert f"timeline of 2 of {len(steps)} steps" in view.summary_label.text()
    sm = view.summary                                    # busy shares are of those steps' time alone
    assert sm.busy_us["compute"] / sm.busy_fraction["compute"] == pytest.approx(sum(s.dur_us for s in shown),
                                                                                rel=1e-6)
    assert view.bar_count("compute") == sum(len(s.lane_spans("compute")) for s in shown)   # their layers alone


def test_timeline_says_when_a_chunked_prefill_shows_some_chunks_only(qtbot, default_model_dir):
    """A chunked prefill at the app's detail rate keeps the timeline of some chunks: the view says how many of how
    many, and its busy figures are over those chunks' time."""
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder

    llm = LLM(str(default_model_dir), device="cpu", mode="chunked", kv_block_size=16, max_model_len=512,
              torch_threads=1, ring_slots=2)
    llm.recorder = rec = TraceRecorder.live()      # 100 tokens in 16-token chunks: 3 of 7 timed
    llm.generate(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))
    llm.close()
    prefill = next(s for s in rec.steps if s.phase == "prefill")
    assert prefill.metrics["parts"] == 7 and len(prefill.windows) == 3
    view = _shown(qtbot, TimelineView())
    view.set_steps([prefill])
    view.fit()
    assert "prefill 100 tok: timeline of 3 of 7 chunks" in view.summary_label.text()
    sm = view.summary
    timed = sum(w1 - w0 for w0, w1 in prefill.windows)
    assert sm.busy_us["compute"] / sm.busy_fraction["compute"] == pytest.approx(timed, rel=1e-6)


def test_hovering_a_span_names_its_layer(qtbot, layerwise_steps):
    view = _shown(qtbot, TimelineView())
    view.set_steps(layerwise_steps)
    last = layerwise_steps[-1]
    _zoom_to(view, last)
    attention = next(s for s in last.spans if s.name == "attention" and s.layer == 3)
    text = _hover(view, (attention.t0_us + attention.t1_us) / 2e3, 0.25)   # row 0 (compute), the nested part
    assert text.startswith("attention") and "layer 3" in text and "duration" in text

    load = next(s for s in last.spans if s.lane == "h2d" and s.bytes > 0)
    text = _hover(view, (load.t0_us + load.t1_us) / 2e3, 1.0)              # row 1 (H2D)
    assert f"layer {load.layer}" in text and f"slot {load.slot}" in text and "GB/s" in text and "KiB" in text
    assert _hover(view, (load.t0_us + load.t1_us) / 2e3, 2.0) == ""     # nothing on D2H in a decode step


def test_follow_live_and_bounded_history(qtbot, layerwise_steps):
    view = _shown(qtbot, TimelineView(max_steps=3))
    assert view.follow and view.follow_button.isChecked()
    for step in layerwise_steps:
        view.append_step(step)
    assert view.steps == layerwise_steps[-3:]
    assert view.bar_count() == sum(len(s.spans) for s in layerwise_steps[-3:])
    x0, x1 = view.visible_ms()
    newest = layerwise_steps[-1]
    assert x0 <= newest.t0_us / 1e3 and newest.t1_us / 1e3 <= x1 <= newest.t1_us / 1e3 + 0.02 * (x1 - x0)

    view.viewbox.setXRange(0, 10, padding=0)       # a narrow window: following keeps its width, ends at the newest
    view.set_follow(True)
    assert view.visible_ms() == pytest.approx((newest.t1_us / 1e3 - 10, newest.t1_us / 1e3))
    view.viewbox.sigRangeChangedManually.emit([True, False])   # what a pan or wheel zoom emits
    assert not view.follow and not view.follow_button.isChecked()
    view.clear()
    assert view.bar_count() == 0 and view.summary_label.text() == "no steps yet"


def test_following_live_shows_the_running_turn_not_the_idle_time_before_it(qtbot, default_model_dir):
    # Two turns of one engine with the user idle between them: following, the view showed both turns and the gap
    # (the H100 screenshot's timeline: 9.5 s wide, its two turns slivers at the edges).
    import time

    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder
    from widgets.trace_common import IDLE_GAP_MS

    llm = LLM(str(default_model_dir), device="cpu", mode="layerwise", ring_slots=2, kv_block_size=16,
              max_model_len=512, torch_threads=1)
    llm.recorder = rec = TraceRecorder()
    llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    first = len(rec.steps)
    time.sleep(IDLE_GAP_MS / 1e3 + 0.3)
    llm.generate([list(range(2000, 2100))], SamplingParams(max_tokens=3, ignore_eos=True))
    steps, llm = list(rec.steps), llm.close()
    turn = steps[first:]
    view = _shown(qtbot, TimelineView())
    view.append_steps(steps[:first])
    view.append_steps(turn)
    x0, x1 = view.visible_ms()
    lo, hi = min(s.t0_us for s in turn) / 1e3, max(s.t1_us for s in turn) / 1e3
    assert steps[first - 1].t1_us / 1e3 < x0 <= lo and hi <= x1 <= hi + 0.02 * (hi - lo)
    assert view.burst_ms() == pytest.approx((lo, hi))
    view.fit()                                             # Fit still shows both turns
    assert view.visible_ms()[0] <= steps[0].t0_us / 1e3
    view.fit_burst()                                       # (the screenshots': the last turn whole)
    x0, x1 = view.visible_ms()
    assert steps[first - 1].t1_us / 1e3 < x0 <= lo and hi <= x1 <= hi + 0.02 * (hi - lo)


def test_a_live_draw_brings_its_summary_and_labels_with_it(qtbot, layerwise_steps):
    """Following live steps, the summary line and the bar labels change in the same draw as the bars (a refresh a
    timer later painted the plot twice), at most every OVERLAY_LIVE_MS; a draw sooner than that refreshes later."""
    from widgets.trace_common import OVERLAY_LIVE_MS
    view = _shown(qtbot, TimelineView())
    view.append_steps(layerwise_steps[:1])
    first = view.summary_label.text()
    assert first.startswith("visible") and view.visible_labels()
    view.append_steps(layerwise_steps[1:2])          # within OVERLAY_LIVE_MS of the last refresh: not yet
    assert view.summary_label.text() == first and view._overlay_timer.isActive()
    qtbot.waitUntil(lambda: view.summary_label.text() != first, timeout=4 * OVERLAY_LIVE_MS)
    second = view.summary_label.text()
    qtbot.wait(OVERLAY_LIVE_MS + 20)
    view.append_steps(layerwise_steps[2:])           # due: refreshed at once
    assert view.summary_label.text() != second and not view._overlay_timer.isActive()


# ---------------------------------------------------------------- ring
def test_ring_view_has_a_row_per_slot_and_the_latest_layers(qtbot, layerwise_steps):
    view = _shown(qtbot, RingView())
    view.set_steps(layerwise_steps)
    last = {}
    for step in layerwise_steps:
        for rec in step.slots:
            last[rec.slot] = rec
    assert view.slots() == sorted(last) and view.rows == [f"slot {s}" for s in sorted(last)]
    assert not view.showing_hint()
    assert view.slot_layers() == {slot: rec.layer for slot, rec in last.items()}
    assert view.table.rowCount() == len(last)
    assert view.table_layers() == {slot: str(rec.layer) for slot, rec in last.items()}

    rec = layerwise_steps[-1].slots[-1]
    _zoom_to(view, layerwise_steps[-1])
    # just inside its interval: at its exact start the ms round trip can land on the previous state's end
    text = _hover(view, (rec.t_us + 0.05) / 1e3, view.slots().index(rec.slot))
    assert f"slot {rec.slot}" in text and rec.state in text and f"{rec.tokens}/{rec.capacity}" in text


def test_ring_table_follows_each_step_and_a_step_without_slot_states_leaves_it_alone(qtbot, layerwise_steps):
    """Steps one at a time, as the pump draws them: the table shows each slot's latest layer and state after every
    step; a step that recorded no slot states (most decode steps at GPU speed) changes no cell."""
    import dataclasses
    view = _shown(qtbot, RingView())
    latest = {}
    for step in [s for s in layerwise_steps if s.slots]:
        view.append_steps([step])
        for rec in step.slots:
            latest[rec.slot] = rec
        assert view.table_layers() == {slot: str(rec.layer) for slot, rec in latest.items()}
        assert [view.table.item(r, 2).text() for r in range(view.table.rowCount())] == \
            [rec.state for _, rec in sorted(latest.items())]
    items = [view.table.item(r, c) for r in range(view.table.rowCount()) for c in range(4)]
    texts = [i.text() for i in items]
    bare = dataclasses.replace(layerwise_steps[-1], step=layerwise_steps[-1].step + 1, spans=[], slots=[],
                               detailed=False)
    view.append_steps([bare])
    after = [view.table.item(r, c) for r in range(view.table.rowCount()) for c in range(4)]
    assert all(a is b for a, b in zip(after, items)) and [i.text() for i in after] == texts


def test_gpu_mode_has_no_ring_and_says_so(qtbot, gpu_steps):
    view = _shown(qtbot, RingView())
    view.set_steps(gpu_steps)
    assert view.showing_hint() and view.hint_label.isVisible()
    assert "gpu mode keeps KV on the device" in view.hint_label.text()
    timeline = _shown(qtbot, TimelineView())
    timeline.set_steps(gpu_steps)
    assert timeline.bar_count("h2d") == 0 and timeline.bar_count("compute") > 0


# ---------------------------------------------------------------- metrics
def test_metrics_strip_shows_copy_bandwidth_and_turn_stats(qtbot, layerwise_steps, gpu_steps):
    strip = _shown(qtbot, MetricsStrip(), h=60)
    strip.update_from_steps(layerwise_steps)
    assert float(strip.value("h2d_gbps")) > 0
    assert float(strip.value("decode_tok_s").replace(",", "")) > 0
    assert strip.value("host_kv").endswith("MiB")
    assert strip.value("gpu_mem") == "—"                      # CPU: no GPU memory figures
    strip.set_stats({"ttft_s": 0.41, "decode_tok_s": 31.3, "prefill_tok_s": 5200.0})
    shown = strip.value("ttft"), strip.value("decode_tok_s"), strip.value("prefill_tok_s")
    assert shown == ("410 ms", "31.3", "5,200")

    gpu = _shown(qtbot, MetricsStrip(), h=60)
    gpu.update_from_steps(gpu_steps)
    assert gpu.value("h2d_gbps") == "—" and gpu.value("host_kv") == "on GPU"


def test_gpu_memory_stays_shown_between_the_steps_that_read_it(qtbot, gpu_steps):
    # On CUDA the engine reads the allocator's figures in detailed steps only (a few a second): the strip showed
    # "—" whenever its window of recent steps held none (the H100 screenshots), though the status bar had it.
    detailed = dataclasses.replace(gpu_steps[0], metrics={**gpu_steps[0].metrics, "gpu_mem_allocated": 3 * 2**30,
                                                           "gpu_mem_peak": 5 * 2**30})
    strip = _shown(qtbot, MetricsStrip(window=4), h=60)
    strip.update_from_steps([detailed])
    assert strip.value("gpu_mem") == "3.0 GiB"
    for _ in range(3):                                      # later ticks: steps without the figure
        strip.update_from_steps(gpu_steps[1:] * 4)
    assert strip.value("gpu_mem") == "3.0 GiB" and strip._values["gpu_mem"].toolTip() == "peak 5.0 GiB"
    strip.clear()                                           # a new engine: nothing known
    strip.update_from_steps(gpu_steps[1:])
    assert strip.value("gpu_mem") == "—"


# ---------------------------------------------------------------- export, menus, colours
def test_views_export_png_and_svg(qtbot, layerwise_steps, tmp_path):
    timeline = _shown(qtbot, TimelineView())
    timeline.set_steps(layerwise_steps)
    ring = _shown(qtbot, RingView())
    ring.set_steps(layerwise_steps)
    strip = _shown(qtbot, MetricsStrip(), h=60)
    strip.update_from_steps(layerwise_steps)
    for name, widget in [("timeline", timeline.plot), ("ring", ring.plot), ("metrics", strip), ("whole", timeline)]:
        png = save_png(widget, tmp_path / f"{name}.png")
        image = QImage(str(png))
        assert not image.isNull() and image.width() > 0 and image.height() > 0, name
        svg = save_svg(widget, tmp_path / f"{name}.svg")
        assert svg.stat().st_size > 0 and "<svg" in svg.read_text(), name


def test_export_actions_and_a_dialog_that_asks_before_overwriting(qtbot, monkeypatch):
    timeline = _shown(qtbot, TimelineView())
    menu_texts = [a.text() for a in timeline.viewbox.menu.actions()]
    assert "Export PNG…" in menu_texts and "Export SVG…" in menu_texts
    strip = _shown(qtbot, MetricsStrip(), h=60)
    assert [a.text() for a in strip.actions()] == ["Export PNG…", "Export SVG…"]
    plain = MetricsStrip()
    qtbot.addWidget(plain)
    assert len(add_export_actions(plain, "x")) == 2

    seen = []
    monkeypatch.setattr(QFileDialog, "exec", lambda self: seen.append(self) or 0)   # the user cancels
    assert ask_save_path(timeline, "png", "timeline") is None
    dialog = seen[0]
    assert dialog.acceptMode() == QFileDialog.AcceptMode.AcceptSave and dialog.defaultSuffix() == "png"
    assert not dialog.testOption(QFileDialog.Option.DontConfirmOverwrite)


def test_colours_read_on_light_and_dark_backgrounds(qtbot):
    for color in list(KIND_COLORS.values()) + list(STATE_COLORS.values()):
        assert contrast_ratio(color, "#FFFFFF") >= 3 and contrast_ratio(color, "#1E1E1E") >= 3, color
    view = _shown(qtbot, TimelineView())
    dark = QPalette(view.palette())
    dark.setColor(QPalette.ColorRole.Base, QColor("#1E1E1E"))
    dark.setColor(QPalette.ColorRole.Text, QColor("#E0E0E0"))
    view.setPalette(dark)
    assert view.plot.backgroundBrush().color() == QColor("#1E1E1E")
    assert view.plot.getPlotItem().getAxis("left").textPen().color() == QColor("#E0E0E0")


def test_the_views_load_without_torch():
    code = ("import sys, widgets.timeline_view, widgets.ring_view, widgets.metrics_strip, widgets.export; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
