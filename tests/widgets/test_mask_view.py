"""The sparse prefill mask view on real traces of the engine (default model, CPU, MInference and XAttention)."""
import numpy as np
import pyqtgraph as pg
import pytest
from PySide6.QtCore import QRectF, QSize

from engine.trace.events import PREFILL
from widgets.export import save_png
from widgets.mask_view import MEAN_HEADS, NO_MASKS_HINT, MaskView

PROMPT = list(range(2000, 2600))          # 600 tokens: sparse above min_len 256
LONGER = PROMPT + list(range(3000, 3100))  # the same 600 and 100 more: 576 of them from the prefix cache
SHORT = list(range(4000, 4100))           # below min_len: dense, no masks


def _run(model_dir, prompts, **kw):
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder

    llm = LLM(str(model_dir), device="cpu", kv_block_size=64, max_model_len=2048, **kw)
    runs = []
    for prompt in prompts:
        rec = TraceRecorder()
        llm.recorder = rec
        llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
        runs.append(list(rec.steps))
    return runs


@pytest.fixture(scope="module")
def mi_runs(default_model_dir):
    return _run(default_model_dir, [PROMPT, LONGER, SHORT], policy="minference",
                policy_params={"min_len": 256, "vertical": 96, "slash": 192, "block": 64, "cpu_dense_above": 1.0})


@pytest.fixture(scope="module")
def mi_steps(mi_runs):
    return mi_runs[0] + mi_runs[1]


@pytest.fixture(scope="module")
def xa_steps(default_model_dir):
    return _run(default_model_dir, [PROMPT], policy="xattention",
                policy_params={"min_len": 256, "threshold": 0.8, "stride": 8, "block": 64, "cpu_dense_above": 1.0})[0]


def _shown(qtbot, widget, w=700, h=700):
    qtbot.addWidget(widget)
    widget.resize(w, h)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def _mask(view, layer=None, head=None):
    layer = view.layer() if layer is None else layer
    head = view.head() if head is None else head
    return view.current().masks[(layer, head)]


def _causal(edges, offset=0):
    """Causal pairs of each cell of the grid (rows before `offset` hold none)."""
    rows = np.arange(offset, edges[-1])
    hi = np.minimum(edges[1:][None], rows[:, None] + 1)
    per_row = np.clip(hi - edges[:-1][None], 0, None)
    out = np.zeros((len(edges) - 1,) * 2)
    np.add.at(out, np.searchsorted(edges, rows, side="right") - 1, per_row)
    return out


def _picture_density(view):
    causal = _causal(view.edges(), view.current().offset)
    return float((view.fractions() * causal).sum() / causal.sum())


def test_minference_mask_is_causal_with_vertical_lines_and_the_recorded_density(qtbot, mi_steps):
    view = _shown(qtbot, MaskView())
    view.set_steps(mi_steps)
    assert not view.showing_hint() and view.prefill_count() == 2
    view.set_prefill_index(0)
    p = view.current()
    assert p.kind == "minference" and p.n == len(PROMPT) and p.offset == 0
    assert p.layers == list(range(30)) and p.n_heads == 9
    assert view.layer() == 0 and view.head() == 0
    img, e = view.image(), view.edges()
    assert img.dtype == np.uint8 and img.shape == (256, 256) and e[0] == 0 and e[-1] == len(PROMPT)
    assert not np.triu(img, 1).any()                       # nothing above the diagonal
    assert (np.diag(img) > 0).all()                        # the recent diagonals: always kept
    m = _mask(view)
    assert f"density {100 * m.density:.1f}%" in view.caption.text()
    assert "MInference" in view.caption.text() and f"{len(PROMPT):,} tokens" in view.caption.text()
    assert f"{len(m.vertical)} verticals, {len(m.slash)} slashes" in view.caption.text()
    assert _picture_density(view) == pytest.approx(m.density, abs=1e-9)   # the picture is what ran
    # a vertical column is lit in every row below it, also where the slash runs leave the columns beside it empty
    through_gaps = 0
    for layer in (0, 5, 10):
        for head in range(0, 9, 2):
            view.set_layer(layer)
            view.set_head(head)
            img, frac, vert = view.image(), view.fractions(), np.asarray(_mask(view).vertical)
            cols = set((np.searchsorted(e, vert, side="right") - 1).tolist())
            for j in sorted(c for c in cols if c > 40 and c - 1 not in cols and c + 1 not in cols):
                assert (img[j + 1:, j] > 0).all() and not img[:j, j].any()
                assert (frac[j + 1:, j] >= 1 / (e[j + 1] - e[j]) - 1e-9).all()
                through_gaps += int(((img[j + 2:, j - 1] == 0) & (img[j + 2:, j + 1] == 0)).sum())
    assert through_gaps > 0


def test_switching_head_and_layer_changes_the_mask_and_the_caption(qtbot, mi_steps):
    view = _shown(qtbot, MaskView())
    view.set_steps(mi_steps)
    view.set_prefill_index(0)
    p = view.current()
    layer = 5
    view.set_layer(layer)
    assert view.layer() == layer and f"layer {layer} · head 0" in view.caption.text()
    per_head = []
    for h in range(p.n_heads):
        view.set_head(h)
        m = _mask(view)
        assert f"head {h}" in view.caption.text() and f"density {100 * m.density:.1f}%" in view.caption.text()
        assert _picture_density(view) == pytest.approx(m.density, abs=1e-9)
        per_head.append(view.fractions())
    assert any(not np.array_equal(per_head[0], f) for f in per_head[1:])
    view.set_head(MEAN_HEADS)
    mean = np.mean([m.density for m in p.heads(layer)])
    assert "mean of 9 heads" in view.caption.text() and f"density {100 * mean:.1f}%" in view.caption.text()
    assert np.allclose(view.fractions(), np.mean(per_head, axis=0))
    assert view.layer_densities()[layer] == pytest.approx(mean)
    before = view.image()
    view.set_layer(20)
    assert view.head() == MEAN_HEADS and "layer 20" in view.caption.text()
    assert not np.array_equal(before, view.image())


def test_a_prefill_after_a_prefix_cache_hit_computes_only_the_new_rows(qtbot, mi_runs):
    view = _shown(qtbot, MaskView())
    view.set_steps(mi_runs[0])
    assert view.prefill_count() == 1 and view.current().n == len(PROMPT)
    view.append_steps(mi_runs[1])                          # following the newest
    p = view.current()
    assert view.prefill_count() == 2 and p.n == len(LONGER) and p.offset == 576
    e, img = view.edges(), view.image()
    cached = e[1:] <= p.offset
    assert cached.any() and not img[cached].any() and img[~cached].any()
    assert "prefix cache" in view.caption.text()
    assert _picture_density(view) == pytest.approx(_mask(view).density, abs=1e-9)
    view.set_prefill_index(0)
    view.append_steps(mi_runs[1])                          # not following: the prefill shown stays
    assert view.current().n == len(PROMPT) and view.prefill_combo.currentIndex() == 0


def test_hover_names_the_token_ranges(qtbot, mi_steps):
    view = _shown(qtbot, MaskView())
    view.set_steps(mi_steps)
    view.set_prefill_index(0)
    m = _mask(view)
    v = int(next(c for c in np.asarray(m.vertical) if 64 <= c < len(PROMPT) - 50))
    text = view.tooltip_at(v, len(PROMPT) - 1)
    e = view.edges()
    j = int(np.searchsorted(e, v, side="right")) - 1
    assert f"queries {e[-2]:,}-{e[-1] - 1:,}" in text and f"keys {e[j]:,}-{e[j + 1] - 1:,}" in text
    assert "of the cell's causal pairs computed" in text and "vertical column" in text
    assert "above the diagonal" in view.tooltip_at(len(PROMPT) - 1, 0)
    assert view.tooltip_at(-5, 3) == ""


def test_xattention_shows_its_kept_blocks(qtbot, xa_steps):
    view = _shown(qtbot, MaskView())
    view.set_steps(xa_steps)
    p = view.current()
    assert not view.showing_hint() and p.kind == "xattention" and p.n == len(PROMPT)
    view.set_layer(3)
    view.set_head(2)
    m = _mask(view)
    img, frac, e = view.image(), view.fractions(), view.edges()
    assert not np.triu(img, 1).any() and (np.diag(img) > 0).all()
    assert "XAttention" in view.caption.text() and f"density {100 * m.density:.1f}%" in view.caption.text()
    assert "verticals" not in view.caption.text()
    assert _picture_density(view) == pytest.approx(m.density, abs=1e-9)
    # each cell inside one (query block, key block) pair below the diagonal shows that block's recorded state
    assert m.image.shape == (10, 10)                       # 600 tokens in 64-token blocks
    blocks = m.image > 0
    assert not blocks.all()                                # sparse: some blocks skipped
    rb, cb = e[:-1] // 64, (e[1:] - 1) // 64
    inside = (rb == (e[1:] - 1) // 64)
    for i in np.flatnonzero(inside):
        for j in np.flatnonzero(inside):
            if cb[j] < rb[i]:
                assert frac[i, j] == (1.0 if blocks[rb[i], cb[j]] else 0.0)


def test_the_grid_shows_each_heads_density_and_a_click_picks_it(qtbot, mi_steps):
    view = _shown(qtbot, MaskView())
    view.set_steps(mi_steps)
    view.set_prefill_index(0)
    p, grid = view.current(), view.head_densities()
    assert grid.shape == (30, 9)
    assert all(grid[i, h] == p.masks[(layer, h)].density for i, layer in enumerate(p.layers) for h in range(9))
    assert len({round(x, 6) for x in grid.ravel()}) > 9                   # heads differ, not one value per layer
    assert np.allclose(grid.mean(axis=1), [view.layer_densities()[layer] for layer in p.layers])
    shown = view.grid_img.image                                           # heads down, layers across
    assert shown.shape == (9, 30) and shown[4, 7] == round(grid[7, 4] * 255)
    vb = view.grid.getPlotItem().getViewBox()
    scene = vb.mapViewToScene(pg.Point(7, 4))                             # the cell of layer 7, head 4
    assert view._grid_cell(scene) == (7, 4)
    view._on_grid_clicked(type("Click", (), {"scenePos": lambda self: scene})())
    assert view.layer() == 7 and view.head() == 4 and "layer 7 · head 4" in view.caption.text()
    assert view.grid_tooltip_at(7, 4) == f"layer 7 · head 4 · density {100 * grid[7, 4]:.1f}%"
    xs, ys = view.grid_mark.getData()                                     # the cell shown is outlined
    assert (min(xs), max(xs), min(ys), max(ys)) == (6.5, 7.5, 3.5, 4.5)
    view.set_head(MEAN_HEADS)
    xs, ys = view.grid_mark.getData()
    assert (min(ys), max(ys)) == (-0.5, 8.5)                              # the mean: the whole column


def test_threaded_binning_draws_what_inline_binning_draws(qtbot, mi_steps):
    inline, threaded = MaskView(), _shown(qtbot, MaskView(threaded=True))
    qtbot.addWidget(inline)
    for view in (inline, threaded):
        view.set_steps(mi_steps)
        view.set_prefill_index(0)
        view.set_layer(9)
        view.set_head(MEAN_HEADS)
    assert threaded.is_binning() and "binning" in threaded.caption.text()    # not computed on the GUI thread
    qtbot.waitUntil(lambda: not threaded.is_binning(), timeout=10_000)
    assert "binning" not in threaded.caption.text()
    assert np.array_equal(threaded.image(), inline.image()) and threaded.image().any()
    mean = threaded.image()
    threaded.set_head(3)
    qtbot.waitUntil(lambda: not threaded.is_binning(), timeout=10_000)
    inline.set_head(3)
    assert np.array_equal(threaded.image(), inline.image())
    threaded.set_head(MEAN_HEADS)                                         # binned before: from the cache, at once
    assert not threaded.is_binning() and np.array_equal(threaded.image(), mean)


def test_no_masks_shows_the_hint(qtbot, mi_runs):
    view = _shown(qtbot, MaskView())
    assert view.showing_hint() and view.hint_label.text() == NO_MASKS_HINT
    view.set_steps(mi_runs[2])                             # a prompt below min_len: dense, no masks
    assert any(s.phase == PREFILL for s in mi_runs[2]) and view.showing_hint() and view.image().size == 0
    view.append_steps([s for s in mi_runs[0] if s.phase != PREFILL])
    assert view.showing_hint()
    view.append_steps(mi_runs[0])
    assert not view.showing_hint() and view.caption.text()
    view.clear()
    assert view.showing_hint() and view.current() is None and view.caption.text() == ""


def test_png_export(qtbot, xa_steps, tmp_path):
    view = _shown(qtbot, MaskView())
    view.set_steps(xa_steps)
    for widget in (view, view.plot):
        path = save_png(widget, tmp_path / "masks.png")
        assert path.stat().st_size > 0
        path.unlink()
    assert [a.text() for a in view.export_actions] == ["Export PNG…", "Export SVG…"]


def _in_window(win, widget, rect=None):
    """`rect` of `widget` (default: all of it) in the window's coordinates."""
    from PySide6.QtCore import QRect
    rect = widget.rect() if rect is None else rect
    return QRect(widget.mapTo(win, rect.topLeft()), rect.size())


@pytest.mark.parametrize("size", ["minimum", (1280, 800)])
def test_the_density_grid_fits_in_the_window(qtbot, tmp_path, mi_steps, size):
    """It used to run past the window's right edge: the grid's plot kept a width it had needed before its tick
    labels were set, wider than the widget showing it. Here the whole grid, every layer and head, lies inside
    the Masks dock, which lies inside the window, at the window's minimum size and at 1280 x 800."""
    from app.main_window import MainWindow

    win = MainWindow({"settings_path": str(tmp_path / "kvscope.ini"), "restore": False, "autostart": False})
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    win.docks["masks"].raise_()
    win.masks.set_steps(mi_steps)
    for _ in range(3):              # the minimum follows the caption's wrapped lines: let the layout settle
        win.resize(win.minimumSizeHint() if size == "minimum" else QSize(*size))
        qtbot.wait(50)
    expected = win.minimumSizeHint() if size == "minimum" else QSize(*size)
    assert win.size() == expected and expected.width() <= 1280 and expected.height() <= 800
    view, grid = win.masks, win.masks.grid
    assert not view.showing_hint() and grid.isVisible() and view.plot.isVisible()

    window = win.rect()
    for outer, inner in [(win, win.docks["masks"]), (win.docks["masks"], view), (view, grid)]:
        assert _in_window(win, outer).contains(_in_window(win, inner)), (outer, inner)
    item = grid.getPlotItem()                                              # title, axes and cells
    assert QRectF(grid.rect()).contains(item.sceneBoundingRect())
    vb = item.getViewBox()
    cells = _in_window(win, grid, grid.mapFromScene(vb.sceneBoundingRect()).boundingRect())
    assert window.contains(cells) and _in_window(win, view).contains(cells)
    (x0, x1), (y0, y1) = vb.viewRange()
    layers, heads = view.head_densities().shape
    assert (x0, x1, y0, y1) == (-0.5, layers - 0.5, -0.5, heads - 0.5)    # every layer and head in view
    assert cells.width() / layers >= 3 and cells.height() / heads >= 3     # each cell a few pixels
    assert _in_window(win, view.plot).right() < cells.left()               # beside the mask, not over it


def test_a_prefill_that_ran_dense_says_why_instead_of_drawing_masks(qtbot, mi_runs, mi_steps):
    """The policy's stats say `sparse: false, reason` (or `dense_layers`): the view says so where masks would be."""
    view = _shown(qtbot, MaskView())
    view.set_steps(mi_runs[2])                        # the short prompt: below min_len, no masks
    view.set_dense_reasons("the prompt (100 tokens) is below min_len 256")
    assert view.showing_hint() and "ran dense (the prompt (100 tokens) is below min_len 256)" in view.hint_label.text()
    view.set_steps(mi_steps)                          # an earlier prefill's masks stay visible, labelled
    assert not view.showing_hint() and "from an earlier prefill: the last one ran dense" in view.caption.text()
    view.set_dense_reasons({"0": "the pattern keeps 40% of the pairs"})
    assert "layer 0 ran dense: the pattern keeps 40% of the pairs" in view.caption.text()
    view.set_dense_reasons(None)
    assert "ran dense" not in view.caption.text()
    view.set_steps([])
    assert view.hint_label.text() == NO_MASKS_HINT
