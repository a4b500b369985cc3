"""The Quest view on real traces of the engine (default model, CPU, layerwise + Quest): what the user sees."""
import numpy as np
import pytest

from engine.trace.events import DECODE
from widgets.export import save_png
from widgets.quest_view import ALL_HEADS, NO_PICKS_HINT, QuestView

DENSE_LAYERS = 2


def _run(model_dir, prompt, **kw):
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder

    llm = LLM(str(model_dir), device="cpu", **kw)
    rec = TraceRecorder()
    llm.recorder = rec
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    return llm, list(rec.steps)


@pytest.fixture(scope="module")
def quest_steps(default_model_dir):
    return _run(default_model_dir, list(range(2000, 2900)), kv_block_size=64, mode="layerwise", max_model_len=2048,
                policy="quest", policy_params={"token_budget": 256, "page_size": 16, "min_context": 0, "min_layer_mb": 0, "dense_layers": DENSE_LAYERS})[1]


@pytest.fixture(scope="module")
def gpu_steps(default_model_dir):
    return _run(default_model_dir, list(range(1000, 1100)), kv_block_size=16, mode="gpu", max_model_len=512)[1]


def _shown(qtbot, widget, w=900, h=420):
    qtbot.addWidget(widget)
    widget.resize(w, h)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def _picked(step):
    return [s for s in step if s.phase == DECODE and s.quest]


def _lit_pages(view, row):
    return set((np.nonzero(view.image()[row])[0] + view.first_page()).tolist())


def _expected(step, layer, head):
    pick = next(p for p in step.quest if p.layer == layer and p.kv_head == head)
    return set(np.asarray(pick.blocks).ravel().tolist())


def test_newest_step_shows_each_sparse_layers_picks_for_the_chosen_head(qtbot, quest_steps):
    decode = _picked(quest_steps)
    assert len(decode) >= 2
    view = _shown(qtbot, QuestView())
    view.set_steps(quest_steps)
    newest = decode[-1]
    assert not view.showing_hint() and view.current_step() is newest and view.follow_check.isChecked()
    n_layers = 1 + max(s.layer for s in quest_steps[0].spans if s.layer is not None)
    assert view.layers() == list(range(DENSE_LAYERS, n_layers)) and view.image().shape[0] == n_layers - 2 == 28
    assert view.image().dtype == np.uint8
    assert view.kv_head() == 0
    for row, layer in enumerate(view.layers()):
        assert _lit_pages(view, row) == _expected(newest, layer, 0)
    ids = np.concatenate([np.asarray(p.blocks).ravel() for p in newest.quest])
    assert view.first_page() == ids.min() and view.image().shape[1] == ids.max() - ids.min() + 1
    # the caption: step, layers, pages chosen / candidates
    pick = newest.quest[0]
    text = view.caption.text()
    assert f"step {newest.step}" in text and "28 layers" in text and f"{len(pick.blocks)} / {pick.n_blocks}" in text
    assert len(pick.blocks) < pick.n_blocks                     # sparse: fewer pages than candidates


def test_switching_the_kv_head_shows_that_heads_picks(qtbot, quest_steps):
    view = _shown(qtbot, QuestView())
    view.set_steps(quest_steps)
    newest = view.current_step()
    heads = sorted({p.kv_head for p in newest.quest})
    assert len(heads) > 1
    before = view.image()
    view.set_kv_head(heads[-1])
    assert view.kv_head() == heads[-1]
    for row, layer in enumerate(view.layers()):
        assert _lit_pages(view, row) == _expected(newest, layer, heads[-1])
    differ = any(_expected(newest, l, 0) != _expected(newest, l, heads[-1]) for l in view.layers())
    assert differ and not np.array_equal(before, view.image())
    # all heads: the fraction of heads choosing each page
    view.set_kv_head(ALL_HEADS)
    row = 0
    layer = view.layers()[row]
    counts = {}
    for h in heads:
        for page in _expected(newest, layer, h):
            counts[page] = counts.get(page, 0) + 1
    img = view.image()
    for page, k in counts.items():
        assert img[row, page - view.first_page()] == round(255 * k / len(heads))
    assert _lit_pages(view, row) == set(counts)


def test_scores_mode_normalises_per_row(qtbot, quest_steps):
    view = _shown(qtbot, QuestView())
    view.set_steps(quest_steps)
    lit = view.image() > 0
    view.set_mode("scores")
    img = view.image()
    assert np.array_equal(img > 0, lit)
    assert (img.max(axis=1) == 255).all()


def test_scrubbing_to_an_earlier_step_shows_its_picks(qtbot, quest_steps):
    decode = _picked(quest_steps)
    view = _shown(qtbot, QuestView())
    view.set_steps(quest_steps)
    view.set_kv_head(1)
    view.slider.setValue(0)                                     # as the user drags the slider
    assert view.current_step() is decode[0] and not view.follow_check.isChecked()
    for row, layer in enumerate(view.layers()):
        assert _lit_pages(view, row) == _expected(decode[0], layer, 1)
    assert f"step {decode[0].step}" in view.caption.text()
    view.append_steps([decode[-1]])                              # not following: the step shown stays
    assert view.current_step() is decode[0]
    view.set_step_index(-1)
    assert view.current_step() is decode[-1] and view.follow_check.isChecked()
    view.clear()
    assert view.showing_hint() and view.current_step() is None


def test_hover_names_layer_page_and_score(qtbot, quest_steps):
    view = _shown(qtbot, QuestView())
    view.set_steps(quest_steps)
    step, layer = view.current_step(), view.layers()[0]
    pick = next(p for p in step.quest if p.layer == layer and p.kv_head == 0)
    page = int(np.asarray(pick.blocks).ravel()[0])
    text = view.tooltip_at(page, 0)
    assert f"layer {layer}" in text and f"page {page}" in text and "score" in text


def test_no_picks_shows_the_hint(qtbot, gpu_steps, quest_steps):
    view = _shown(qtbot, QuestView())
    view.set_steps(gpu_steps)
    assert view.showing_hint() and view.hint_label.text() == NO_PICKS_HINT and view.image().size == 0
    view.append_steps([s for s in quest_steps if s.phase != DECODE])   # prefill, load: no decode picks
    assert view.showing_hint()
    view.append_steps(quest_steps)
    assert not view.showing_hint()


def test_png_export(qtbot, quest_steps, tmp_path):
    view = _shown(qtbot, QuestView())
    view.set_steps(quest_steps)
    for widget in (view, view.plot):
        path = save_png(widget, tmp_path / "quest.png")
        assert path.stat().st_size > 0
        path.unlink()
    assert [a.text() for a in view.export_actions] == ["Export PNG…", "Export SVG…"]


def test_recall_of_the_picks_shows_when_measured(qtbot, default_model_dir, quest_steps):
    steps = _run(default_model_dir, list(range(2000, 2900)), kv_block_size=64, mode="layerwise", max_model_len=2048,
                 policy="quest", policy_params={"token_budget": 256, "page_size": 16, "min_context": 0, "min_layer_mb": 0, "dense_layers": DENSE_LAYERS,
                                                "recall": True})[1]
    view = _shown(qtbot, QuestView())
    view.set_steps(steps)
    picked = _picked(steps)
    assert len(picked) >= 2
    view.set_step_index(0)                                   # its picks were loaded, and measured, at the next step
    nxt = next(s for s in steps if s.step == picked[0].step + 1)
    recall = view.recall()
    assert set(recall) == set(view.layers()) and len(recall) == 30 - DENSE_LAYERS
    assert all(recall[layer] == nxt.metrics[f"quest_recall_l{layer}"] for layer in recall)
    assert all(0 < r <= 1 for r in recall.values())
    low = min(recall, key=recall.get)
    assert f"lowest: layer {low}" in view.caption.text() and "recall " in view.caption.text()
    assert f"layer {low} · page" in view.tooltip_at(view.first_page(), view.layers().index(low))
    assert "recall" in view.tooltip_at(view.first_page(), view.layers().index(low))
    view.set_step_index(-1)                                  # the newest picks: not loaded yet
    assert view.recall() == {} and "recall" not in view.caption.text()
    view.set_steps(quest_steps)                              # not measured
    view.set_step_index(0)
    assert view.recall() == {} and "recall" not in view.caption.text()


def test_a_turn_without_picks_says_why_quest_loaded_everything(qtbot):
    view = _shown(qtbot, QuestView())
    view.set_dense_reason("the context (900 tokens) is below min_context 8192: loading all of it costs less")
    assert view.showing_hint() and "below min_context 8192" in view.hint_label.text()
    view.set_dense_reason(None)
    assert "choose the Quest policy" in view.hint_label.text()
