"""engine.trace: what a recorded step holds (a timeline at the detail rate; Quest picks recorded in bulk)."""
import pickle
import time

import numpy as np
import pytest
import torch

from engine.trace import TraceRecorder


def test_a_decode_timeline_waits_a_full_interval_after_a_prefill_ends():
    """At a detail rate the decode steps after a long prefill get no timeline of their own until 1/detail_hz has
    passed since the prefill's end (the prefill's own timeline is the one just drawn), except the second one, so that
    a short answer shows one decode timeline too; then the rate holds from it."""
    rec = TraceRecorder(detail_hz=20.0)                 # every 50 ms
    for turn in range(2):
        rec.begin_step("prefill", 100)
        time.sleep(0.08)                                # a prefill longer than the interval
        rec.end_step()
        for _ in range(3):                              # fast decode steps: only the second is detailed
            rec.begin_step("decode", 1)
            rec.end_step()
        time.sleep(0.06)
        rec.begin_step("decode", 1)                     # a full interval after the last detailed one
        assert rec.detail
        rec.end_step()
    assert [s.detailed for s in rec.steps] == [True, False, True, False, True] * 2


def test_bulk_quest_picks_expand_per_layer_and_head_and_pickle_as_arrays():
    """A step's picks recorded in bulk read as one QuestPick per (layer, kv head), and cross a pipe as arrays."""
    rec = TraceRecorder()
    L, H, k = 4, 3, 5
    pages = torch.arange(L * H * k).reshape(L, H, k)
    scores = torch.rand(L, H, k)
    rec.begin_step("decode", 1)
    rec.quest_picks([2, 3, 4, 5], pages, scores, [40, 41, 42, 43], pages + 1000, 16)
    pages += 7                                     # later in-place changes do not reach the record
    step = rec.end_step()
    assert len(step.quest) == L * H and bool(step.quest)
    picks = {(p.layer, p.kv_head): p for p in step.quest}
    assert sorted(picks) == [(layer, h) for layer in (2, 3, 4, 5) for h in range(H)]
    p = picks[(4, 1)]
    assert p.blocks.tolist() == list(range((2 * H + 1) * k, (2 * H + 2) * k)) and p.n_blocks == 42
    assert p.positions.tolist() == (p.blocks + 1000).tolist() and p.page_size == 16 and p.step == step.step
    assert np.allclose(p.scores, scores[2, 1].numpy())
    blob = pickle.dumps(step)
    back = pickle.loads(blob)
    assert [(q.layer, q.kv_head, q.blocks.tolist(), q.scores.tolist()) for q in back.quest] == \
           [(q.layer, q.kv_head, q.blocks.tolist(), q.scores.tolist()) for q in step.quest]
    # three arrays (int32 pages and positions, float32 scores) and little else, not 12 objects of 3 arrays each
    assert len(blob) < 3 * L * H * k * 4 + 1500


def test_the_live_timeline_rate_follows_what_the_window_draws():
    """The views redraw ~1.5 times a second in the offload modes on a GPU and once every 1-2 s on a CPU: three
    timelines a second there, one on a CPU, ten in gpu mode on a GPU."""
    from engine.trace import LIVE_DETAIL_HZ, LOW_DETAIL_HZ, live_detail_hz
    from engine.trace.events import CPU_DETAIL_HZ
    assert live_detail_hz("cuda:0", "layerwise") == live_detail_hz("cuda", "chunked") == LOW_DETAIL_HZ == 3.0
    assert live_detail_hz("cpu", "layerwise") == live_detail_hz("cpu", "gpu") == CPU_DETAIL_HZ == 1.0
    assert live_detail_hz("cuda:0", "gpu") == LIVE_DETAIL_HZ == 10.0
    assert TraceRecorder.live("cpu", mode="layerwise")._detail_every_us == pytest.approx(1e6 / CPU_DETAIL_HZ)
