"""Two real recordings (the default model, Quest at two budgets) compared in the window and rendered headless."""
import json

import numpy as np
import pytest
from PySide6.QtCore import QPointF
from PySide6.QtGui import QImage

from app.cli import main
from app.compare_window import CompareWindow
from engine.trace.compare import compare
from engine.trace.recording import load_recording, save_recording
from tests.app.test_window import _pixel_std
from tests.engine.test_recording import record


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("cmp")
    prompt = list(range(2000, 2900))
    paths = []
    for budget in (128, 256):
        params = {"token_budget": budget, "page_size": 16, "dense_layers": 2, "min_context": 0, "min_layer_mb": 0}
        paths.append(save_recording(record(default_model_dir, "quest", params, prompt, tokens=4),
                                    tmp / f"quest{budget}.kvscope"))
    return paths


def test_the_compare_view_shows_the_overlap_the_figures_and_the_answers(qtbot, pair):
    a, b = (load_recording(p) for p in pair)
    win = CompareWindow(a, b)
    qtbot.addWidget(win)
    win.show()
    view, cmp = win.view, compare(a, b)
    shown = view.quest_image()
    assert shown.shape == cmp.quest_jaccard.shape and np.isfinite(shown[2:]).all()     # sparse layers 2..
    assert 0 < np.nanmean(shown) < 1                     # a budget twice as large picks more: partial overlap
    assert "aligned steps" in view.quest.caption.text() and cmp.quest_steps == 3
    rows = {view.figures_table.item(r, 0).text(): view.figures_table.item(r, 3).text()
            for r in range(view.figures_table.rowCount())}
    assert rows["answer tokens"] == "1.00×" and "KV host→device per decode step (MiB)" in rows
    if cmp.first_difference is None:
        assert view.difference_label.text() == "The answers are the same."
    else:
        assert f"character {cmp.first_difference}" in view.difference_label.text()
    assert view.timeline_a.bar_count() > 0 and view.timeline_b.bar_count() > 0
    assert view.timeline_a.visible_ms() == pytest.approx(view.timeline_b.visible_ms())      # one time scale
    assert not view.masks.plot.isVisible() and "neither turn ran a sparse prefill" in view.masks.caption.text()
    pp = view.pick_pair                                  # opens at the layer and head where A and B agree least
    worst = np.nanargmin(np.where(np.isfinite(shown), shown, np.inf))
    assert (pp.layer.value(), pp.head.value()) == divmod(int(worst), shown.shape[1])
    assert pp.values.shape[0] == 3 and {2, 3} <= set(np.unique(pp.values).tolist())   # B's extra pages, shared ones
    assert "pages a step" in pp.caption.text()
    step, page = map(int, np.argwhere(pp.values == 3)[0])           # a page both picked
    at = pp.plot.getPlotItem().getViewBox().mapViewToScene(QPointF(page, step))
    pp.plot.scene().sigMouseMoved.emit(at)                        # hovering it names it and shows its text
    assert pp.hover_label.text() == (f"Decode step {step}, page {page} (tokens {page * 16:,}–{page * 16 + 15:,}): "
                                     f"picked by both · “{'x' * 16}”")   # (the recordings' document: x per token)
    cmp.parting_step = 1                                 # answers that part at the second token: a line there
    pp.set_comparison(cmp)
    assert pp.parting.isVisible() and pp.parting.value() == 0.5 and "from decode step 1 on" in pp.caption.text()


def test_against_full_attention_the_picks_of_the_quest_side_show_alone(qtbot, pair, default_model_dir, tmp_path):
    full = record(default_model_dir, "full", {}, list(range(2000, 2900)), tokens=4)
    win = CompareWindow(load_recording(pair[0]), full)
    qtbot.addWidget(win)
    win.show()
    view = win.view
    assert "only one" in view.quest.caption.text()
    pp = view.pick_pair
    assert pp.isVisible() and set(np.unique(pp.values).tolist()) == {0, 1}    # A's pages; B loads every page
    assert "B picked nothing here" in pp.caption.text()


def test_render_writes_each_recordings_views_and_a_comparison_sheet(capsys, pair, tmp_path):
    out = tmp_path / "figures"
    assert main(["render", str(pair[0]), str(pair[1]), "--out", str(out), "--size", "1280x800"]) == 0
    for stem in ("quest128", "quest256"):
        for name in ("window", "timeline", "quest", "ring", "chat"):
            img = QImage(str(out / stem / f"{name}.png"))
            assert not img.isNull() and _pixel_std(img) > 5, (stem, name)
        assert QImage(str(out / stem / "window.png")).size().toTuple() == (1280, 800)
    sheet = QImage(str(out / "compare" / "compare.png"))
    assert sheet.width() == 1280 and sheet.height() > 600 and _pixel_std(sheet) > 5
    data = json.loads((out / "compare" / "comparison.json").read_text())
    assert data["quest_aligned_steps"] == 3 and len(data["quest_jaccard"]) == 30
    assert {f["name"] for f in data["figures"]} >= {"time to first token (s)", "decode (tok/s)"}
    assert (out / "compare" / "compare.svg").read_text().startswith("<?xml")


def test_render_refuses_a_file_that_is_not_a_recording_and_a_bad_folder(capsys, pair, tmp_path):
    bad = tmp_path / "x.kvscope"
    bad.write_text("no")
    assert main(["render", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "not a kvscope recording" in capsys.readouterr().err
    (tmp_path / "f").write_text("a file")
    assert main(["render", str(pair[0]), "--out", str(tmp_path / "f" / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and "is a file, not a folder" in err and not (tmp_path / "o").exists()


def test_two_prefill_masks_are_shown_side_by_side_with_their_difference(qtbot, default_model_dir):
    """MInference with few and with more vertical and slash lines on the same prompt: B computes more."""
    prompt = list(range(3000, 3300))
    base = {"min_len": 64, "block": 16, "sink": 4, "recent": 16, "cpu_dense_above": 1.0}
    a, b = (record(default_model_dir, "minference", {**base, "vertical": v, "slash": sl}, prompt, tokens=2)
            for v, sl in ((8, 16), (32, 64)))
    win = CompareWindow(a, b)
    qtbot.addWidget(win)
    pair = win.view.mask_pair
    pair.layer.setValue(1)
    pair.head.setValue(2)
    da, db = pair.density(0), pair.density(1)
    assert da.shape == db.shape and np.nanmean(db) > np.nanmean(da)             # more lines: more pairs kept
    np.testing.assert_allclose(pair.diff.values, db - da)
    assert np.isnan(da[0, -1]) and np.nanmax(db) <= 1.0                          # nothing above the diagonal
    assert "layer 1, head 2" in pair.a.caption.text()
    density_a, density_b = win.view.comparison.mask_density
    assert density_b[1, 2] > density_a[1, 2]
    pair.head.setValue(-1)
    assert "mean of the heads" in pair.b.caption.text()
