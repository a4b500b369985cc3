"""Comparing two recorded turns (engine/trace/compare.py): the first difference, Quest's overlap, masks, figures."""
import math

import numpy as np
import pytest

from engine.trace.compare import (compare, first_difference, from_zero, layer_recall, mask_densities, parting_token,
                                  pick_raster, quest_overlap)
from engine.trace.events import MaskSummary, QuestPicks, Span, StepTrace
from engine.trace.recording import Recording


def decode(step: int, positions: np.ndarray, t0: float = 0.0) -> StepTrace:
    """A decode step whose picks are `positions` [layers, kv heads, k]."""
    layers = list(range(positions.shape[0]))
    bulk = [(step, layers, positions + 1000, np.ones(positions.shape, np.float32), [64] * len(layers), positions, 16)]
    return StepTrace(step, "decode", 1, t0, t0 + 10, [Span("compute", "layer 0", t0 + 1, t0 + 2, 0)],
                     quest=QuestPicks([], bulk), metrics={"bytes_h2d": 2.0 ** 20})


def test_first_difference():
    assert first_difference("Bergen is", "Bergen is") is None
    assert first_difference("Bergen is", "Bergen was") == 7
    assert first_difference("Bergen", "Bergen, on Tuesday") == 6 and first_difference("", "x") == 0


def test_quest_overlap_is_the_mean_jaccard_of_aligned_steps_per_layer_and_head():
    a = np.array([[[1, 2, 3, 4], [5, 6, 7, 8]]])            # 1 layer, 2 kv heads, k = 4
    b = np.array([[[1, 2, 3, 9], [10, 11, 12, 13]]])
    c = np.array([[[1, 2, 3, 4], [5, 6, 7, 8]]])
    j, n, per_step = quest_overlap([decode(0, a), decode(1, a), decode(2, a)], [decode(5, b), decode(6, c)])
    assert n == 2                                           # the third step of A has no partner
    assert j[0, 0] == pytest.approx((3 / 5 + 1) / 2) and j[0, 1] == pytest.approx((0 + 1) / 2)
    np.testing.assert_allclose(per_step, [(3 / 5 + 0) / 2, 1.0])     # per step: the mean over its kv heads
    none, n, per_step = quest_overlap([decode(0, a)], [])
    assert none is None and n == 0 and per_step.size == 0


def test_pick_raster_shows_each_sides_pages_and_both():
    a = np.array([[[1, 2, 3, 4], [5, 6, 7, 8]]])
    b = np.array([[[1, 2, 3, 9], [10, 11, 12, 13]]])
    raster = pick_raster([decode(0, a), decode(1, a)], [decode(5, b)], 0, 0)
    assert raster.shape == (2, 10)                          # two steps (B has one), pages 0..9
    assert raster[0].tolist() == [0, 3, 3, 3, 1, 0, 0, 0, 0, 2]
    assert raster[1].tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]     # B's second step is missing
    full = StepTrace(7, "decode", 1, 0, 10, metrics={})     # a policy without picks: only A's pages
    assert set(pick_raster([decode(0, a)], [full], 0, 1).ravel()) == {0, 1}


def test_parting_token_and_layer_recall():
    assert parting_token([3, 7, 10], [3, 7, 12], 8) == 2    # the third token is the first to differ
    assert parting_token([3, 7], [3, 7, 9], 7) == 2         # A ends where B goes on
    assert parting_token([3, 7], [], 0) == 0 and parting_token([], [], 4) is None
    assert parting_token([3, 7], [3, 7], None) is None
    steps = [StepTrace(i, "decode", 1, 0, 1, metrics={"quest_recall_l3": r}) for i, r in enumerate((0.9, 0.7))]
    assert layer_recall(steps, 3) == pytest.approx(0.8) and math.isnan(layer_recall(steps, 2))


def test_mask_densities_and_a_comparison_of_two_documents():
    masks = [MaskSummary(l, h, np.arange(3), np.arange(2), 100, 0.1 * (l + 1) + 0.01 * h) for l in range(2)
             for h in range(3)]
    prefill = StepTrace(0, "prefill", 100, 0, 50, masks=masks, metrics={})
    d = mask_densities([prefill])
    assert d.shape == (2, 3) and d[1, 2] == pytest.approx(0.22)
    a = Recording({"host": "a"}, "doc one", [{"question": "q", "answer": "Bergen is", "first_step": 0, "last_step": 1,
                                            "stats": {"ttft_s": 0.5, "decode_tok_s": 100.0, "completion_tokens": 2}}],
                  [prefill, decode(1, np.array([[[1, 2]]]), 60)])
    b = Recording({"host": "b"}, "doc two", [{"question": "q", "answer": "Bergen was", "first_step": 0,
                                            "last_step": 0, "stats": {"ttft_s": 1.0, "decode_tok_s": 50.0,
                                                                      "completion_tokens": 2}}], [prefill])
    cmp = compare(a, b)
    assert cmp.first_difference == 7 and any("different documents" in n for n in cmp.notes)
    figures = {name: (x, y, r) for name, x, y, r in cmp.figures}
    assert figures["time to first token (s)"] == (0.5, 1.0, 2.0)
    assert figures["decode (tok/s)"][2] == pytest.approx(0.5)
    assert figures["KV host→device per decode step (MiB)"][0] == pytest.approx(1.0)
    assert cmp.quest_jaccard is None and cmp.quest_steps == 0       # B has no decode step with picks
    assert cmp.parting_step is None                                  # (no token ends recorded)
    a.turns[0]["stats"]["token_ends"], b.turns[0]["stats"]["token_ends"] = [6, 9], [6, 10]
    assert compare(a, b).parting_step == 1                           # " is" / " was": the second token
    np.testing.assert_allclose(cmp.mask_density[0], cmp.mask_density[1])
    with pytest.raises(ValueError, match="without a finished turn"):
        compare(a, Recording({}, "", [], []))


def test_from_zero_moves_a_turn_to_start_at_zero():
    steps = from_zero([decode(3, np.array([[[1]]]), t0=5000.0), decode(4, np.array([[[1]]]), t0=5020.0)])
    assert [s.t0_us for s in steps] == [0.0, 20.0] and steps[1].spans[0].t0_us == pytest.approx(21.0)
    assert not math.isnan(steps[0].t1_us)

