"""engine.trace: recorders, Chrome/Perfetto export and its validator, interval summaries (CPU; one gpu test)."""
import gc
import gzip
import json
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

from engine.trace import (COMPUTE, D2H, H2D, HOST, LANES, NULL_SPAN, Recorder, SlotState, Span, StepTrace,
                          TraceRecorder, check_chrome_trace, read_chrome_trace, summarize, summarize_chrome_trace,
                          to_chrome_trace, write_chrome_trace)


def hand_made_step(step=0, offset=0.0) -> StepTrace:
    o = offset
    spans = [Span(COMPUTE, "layer 0", o + 0, o + 10, layer=0), Span(COMPUTE, "layer 1", o + 20, o + 30, layer=1),
             Span(H2D, "load kv", o + 5, o + 25, layer=1, bytes=20_000, slot=1),
             Span(D2H, "save kv", o + 28, o + 40, layer=1, bytes=6_000, slot=1)]
    slots = [SlotState(o + 5, 1, 1, "loading", 0, 64), SlotState(o + 25, 1, 1, "ready", 64, 64),
             SlotState(o + 26, 0, 0, "free", 0, 64)]
    return StepTrace(step, "prefill", 4096, o, o + 40, spans, slots, [], [], {"mem_gpu_gb": 1.5, "ttft_ms": 3.0},
                     "cpu")


# ---------------------------------------------------------------- summary
def test_summary_of_known_spans():
    # compute [0,10] [20,30]; h2d [5,25]; d2h [28,40]; window = the step [0, 40] (40 µs)
    # busy: compute 20/40 = 0.5, h2d 20/40 = 0.5, d2h 12/40 = 0.3, host 0
    # copy union: [5,25] + [28,40] = 32 µs
    # compute ∩ copy: [5,10] 5 + [20,25] 5 + [28,30] 2 = 12 µs  -> overlap 12/32 = 0.375; exposed 32-12 = 20 µs
    # h2d: 20 kB in 20 µs = 1 GB/s; d2h: 6 kB in 12 µs = 0.5 GB/s
    s = summarize(hand_made_step())
    assert (s.t0_us, s.t1_us) == (0, 40)
    assert s.busy_fraction == {COMPUTE: 0.5, H2D: 0.5, D2H: 12 / 40, HOST: 0.0}
    assert s.copy_us == 32 and s.overlap_fraction == 0.375 and s.exposed_copy_us == 20
    assert s.gbps[H2D] == pytest.approx(1.0) and s.gbps[D2H] == pytest.approx(0.5)
    assert s.span_count == {COMPUTE: 2, H2D: 1, D2H: 1, HOST: 0}
    assert json.loads(json.dumps(s.to_dict()))["overlap_fraction"] == 0.375


def test_summary_window_steps_and_no_copies():
    steps = [hand_made_step(0), hand_made_step(1, offset=100)]
    both = summarize(steps)
    assert (both.t0_us, both.t1_us) == (0, 140) and both.copy_us == 64 and both.exposed_copy_us == 40
    # window [20, 30]: compute all the way, h2d [20,25], d2h [28,30] -> copy 7, all overlapped
    w = summarize(steps, t0=20, t1=30)
    assert w.busy_fraction[COMPUTE] == 1.0 and w.copy_us == 7 and w.overlap_fraction == 1.0
    assert w.exposed_copy_us == 0 and w.bytes[H2D] == pytest.approx(5e3)  # a quarter of the 20 kB span
    # overlapping spans of one lane count once; no copies -> overlap 0
    s = summarize([Span(COMPUTE, "a", 0, 10), Span(COMPUTE, "b", 5, 15), Span(HOST, "c", 0, 20)])
    assert s.busy_fraction[COMPUTE] == 0.75 and s.overlap_fraction == 0.0 and s.exposed_copy_us == 0


def test_summary_from_kept_lane_arrays_equals_the_one_from_spans():
    """The timeline keeps each step's `lane_arrays` and summarizes from them: the same figures, any window."""
    from engine.trace.summary import lane_arrays
    steps = [hand_made_step(0), hand_made_step(1, offset=100), hand_made_step(2, offset=150)]   # 2 overlaps 1
    steps[1].spans.append(Span(HOST, "plan", 120, 121))
    arrays = [lane_arrays(step.spans) for step in steps]
    for t0, t1 in ((None, None), (20, 30), (5, 160), (130, 170)):
        assert summarize(steps, t0=t0, t1=t1, arrays=arrays) == summarize(steps, t0=t0, t1=t1)
    assert summarize(steps, arrays=arrays).busy_us[HOST] == 1


# ---------------------------------------------------------------- chrome export and validator
def test_chrome_trace_of_hand_made_steps_is_valid():
    obj = to_chrome_trace([hand_made_step(0), hand_made_step(1, offset=100)])
    assert check_chrome_trace(obj) == []
    assert obj["displayTimeUnit"] == "ms"
    summary = summarize_chrome_trace(obj)
    assert summary["tracks"] == {"steps": 2, COMPUTE: 4, H2D: 2, D2H: 2, HOST: 0}
    assert summary["counters"] == {"ring slots": 6, "mem_gpu_gb": 2}  # ttft_ms is not a memory counter
    x = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in x if e["cat"] == "steps"]
    assert [e["name"] for e in steps] == ["prefill 4096 tok"] * 2
    h2d = next(e for e in x if e["cat"] == H2D)
    assert h2d["args"]["bytes"] == 20_000 and h2d["args"]["GB/s"] == 1.0 and h2d["args"]["slot"] == 1
    ring = [e for e in obj["traceEvents"] if e["ph"] == "C" and e["name"] == "ring slots"]
    assert ring[1]["args"] == {"free": 0, "loading": 0, "ready": 1, "computing": 0}
    assert ring[2]["args"] == {"free": 1, "loading": 0, "ready": 1, "computing": 0}


def test_validator_catches_broken_traces():
    def thread(tid, name):
        return {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}

    def x(tid, ts, dur, name="s"):
        return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}

    good = [thread(2, "compute"), x(2, 0, 10), x(2, 2, 3), x(2, 10, 5)]  # nested, then adjacent
    assert check_chrome_trace({"traceEvents": good}) == []
    partial = [thread(2, "compute"), x(2, 0, 10, "a"), x(2, 5, 10, "b")]
    assert any("partly overlaps" in p for p in check_chrome_trace({"traceEvents": partial}))
    unnamed = [thread(2, "compute"), x(3, 0, 1)]
    assert any("no thread_name" in p for p in check_chrome_trace({"traceEvents": unnamed}))
    negative = [thread(2, "compute"), x(2, 0, -1)]
    assert any("negative dur" in p for p in check_chrome_trace({"traceEvents": negative}))
    bad_counter = [{"ph": "C", "pid": 1, "tid": 0, "name": "c", "ts": 0, "args": {"v": "high"}}]
    assert check_chrome_trace({"traceEvents": bad_counter})
    assert check_chrome_trace({"traceEvents": [{"ph": "X", "pid": 1, "ts": 0, "dur": 1}]})  # no tid, no name
    # within the 0.001 µs tolerance is fine
    assert check_chrome_trace({"traceEvents": [thread(2, "c"), x(2, 0, 10), x(2, 9.9995, 1)]}) == []


def test_partly_overlapping_spans_go_to_overflow_tracks():
    # two copy threads: h2d [0,10] and [5,15] partly overlap; [6,8] nests in the second (and in the first)
    spans = [Span(H2D, "a", 0, 10), Span(H2D, "b", 5, 15), Span(H2D, "c", 6, 8), Span(H2D, "d", 12, 20)]
    obj = to_chrome_trace([StepTrace(0, "decode", 1, 0, 20, spans)])
    assert check_chrome_trace(obj) == []
    tracks = summarize_chrome_trace(obj)["tracks"]
    assert tracks[H2D] + tracks[f"{H2D} #2"] == 4 and tracks[f"{H2D} #2"] >= 1
    tids = {e["tid"] for e in obj["traceEvents"] if e["ph"] == "X" and e["cat"] == H2D}
    base = next(e["tid"] for e in obj["traceEvents"] if e["ph"] == "M" and e.get("args", {}).get("name") == H2D)
    assert tids == {base, base + 100}


def test_metrics_and_span_args_become_plain_json_values():
    """numpy scalars and arrays, nested dicts with int keys, NaN and inf: strict JSON (NaN / inf as null)."""
    metrics = {"a": 1, "b": 2.5, "c": float("nan"), "d": float("inf"), "e": np.float32(0.25), "f": np.int64(7),
               "g": True, "h": None, "i": "x", "j": {3: np.float64(1.5), 4: [np.int32(1), 2.0]}, "k": np.arange(2)}
    spans = [Span(H2D, "load", 0, 10, 1, 64, None, {"pages": np.int64(3), "share": float("nan")})]
    obj = to_chrome_trace([StepTrace(0, "decode", 1, 0, 20, spans, metrics=metrics)])
    events = json.loads(json.dumps(obj, allow_nan=False))["traceEvents"]
    step = next(e for e in events if e["ph"] == "X" and e["cat"] == "steps")["args"]
    assert {k: step[k] for k in metrics} == {"a": 1, "b": 2.5, "c": None, "d": None, "e": 0.25, "f": 7, "g": True,
                                             "h": None, "i": "x", "j": {"3": 1.5, "4": [1, 2.0]}, "k": [0, 1]}
    load = next(e for e in events if e["ph"] == "X" and e["name"] == "load")["args"]
    assert load["pages"] == 3 and load["share"] is None and load["bytes"] == 64


def test_write_gzip_round_trip_leaves_no_temp_file(tmp_path):
    steps = [hand_made_step(0), hand_made_step(1, offset=100)]
    for name, kw in (("t.json.gz", {}), ("t.json", {}), ("forced", {"gzip": True})):
        path = write_chrome_trace(steps, tmp_path / name, **kw)
        raw = path.read_bytes()
        assert (raw[:2] == b"\x1f\x8b") == (name != "t.json")
        assert read_chrome_trace(path) == to_chrome_trace(steps)
    assert json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forced", "t.json", "t.json.gz"]


# ---------------------------------------------------------------- recorders
def test_history_is_bounded_and_numbered():
    seen = []
    rec = TraceRecorder(max_steps=100)
    rec.on_step = seen.append
    for i in range(1000):
        rec.begin_step("decode", 1)
        rec.end_step({"i": i})
    assert len(rec.steps) == 100 and [s.step for s in rec.steps] == list(range(900, 1000))
    assert rec.last is rec.steps[-1] and rec.last.metrics == {"i": 999} and len(seen) == 1000
    rec.clear()
    assert len(rec.steps) == 0 and rec.last is None and rec.end_step() is None


def test_noop_recorder_is_free():
    rec = Recorder()
    assert not rec.enabled and rec.span(COMPUTE, "x") is rec.span(H2D, "y", 3, bytes=5, foo=1) is NULL_SPAN
    rec.begin_step("decode", 1)
    with rec.span(COMPUTE, "x", 0) as s:
        assert s is None
    assert rec.end_step({"a": 1.0}) is None and rec.last is None and len(rec.steps) == 0

    def loop(n):
        for i in range(n):
            rec.begin_step("decode", 1)
            with rec.span(COMPUTE, "attn", i, slot=1):
                pass
            rec.slot_state(1, i, "ready", 1, 2)
            rec.end_step()

    loop(1000)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    loop(10_000)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    grown = sum(d.size_diff for d in after.filter_traces(ignore).compare_to(before.filter_traces(ignore), "filename")
                if d.size_diff > 0)
    assert grown < 1024  # 10,000 calls of each method keep nothing (a leak of 1 object per call would be ~500 kB)
    assert not vars(rec)  # nothing kept on the instance


def test_cpu_spans_from_threads_land_in_the_step():
    rec = TraceRecorder()
    rec.begin_step("prefill", 128)
    start = threading.Barrier(2)

    def copier():
        start.wait()
        for i in range(50):
            with rec.span(H2D, "load", i, bytes=1024, slot=i % 2):
                time.sleep(0.0001)

    t = threading.Thread(target=copier)
    t.start()
    start.wait()
    for i in range(50):
        with rec.span(COMPUTE, "layer", i):
            time.sleep(0.0002)
    t.join()
    rec.quest_pick(3, 0, np.array([1, 5]), torch.tensor([0.5, 0.25], dtype=torch.bfloat16), 8)
    step = rec.end_step({"mem_host_gb": 0.1})
    assert step.step == 0 and step.phase == "prefill" and step.n_tokens == 128 and step.device == "cpu"
    assert len(step.lane_spans(COMPUTE)) == 50 and len(step.lane_spans(H2D)) == 50
    assert all(step.t0_us <= s.t0_us <= s.t1_us <= step.t1_us for s in step.spans)
    assert [s.lane for s in step.spans] == sorted((s.lane for s in step.spans), key=LANES.index)
    h2d = step.lane_spans(H2D)
    assert all(a.t0_us <= b.t0_us for a, b in zip(h2d, h2d[1:])) and h2d[0].bytes == 1024
    q = step.quest[0]
    assert isinstance(q.scores, np.ndarray) and q.scores.tolist() == [0.5, 0.25] and q.step == 0
    # the main thread's and the copier's spans really ran at the same time
    assert summarize(step).overlap_fraction > 0
    assert check_chrome_trace(to_chrome_trace(rec.steps)) == []


def test_masks_added_spans_and_an_unclosed_step():
    rec = TraceRecorder()
    rec.begin_step("prefill", 64)
    vertical = torch.arange(4)[None]                                 # [heads, lines]: one head
    rec.mask_summaries(1, vertical, np.array([[0, 3]]), 64, torch.tensor([0.25]), torch.ones(1, 2, 2).bfloat16())
    vertical[0, 0] = 99  # later in-place changes do not reach the record
    t = rec.now_us()
    rec.add_span(Span(HOST, "tokenize", t, t + 5.0))
    rec.begin_step("decode", 1)  # the prefill was never ended: closed now, marked incomplete
    first, second = rec.steps[0], rec.end_step()
    assert first.metrics == {"incomplete": 1.0} and first.spans[0].name == "tokenize" and first.t1_us >= t + 5
    m = first.masks[0]
    assert m.vertical.tolist() == [0, 1, 2, 3] and m.image.dtype == np.float32 and m.density == 0.25
    assert second.step == 1 and second.phase == "decode" and not second.spans and second.t0_us >= first.t0_us


def test_a_layers_masks_in_one_call_come_out_per_head():
    """mask_summaries (a layer's heads at once, as the prefill policies record them): one MaskSummary per head,
    numpy, safe from later in-place changes; no vertical/slash (XAttention's blocks) gives empty int32 lines."""
    rec = TraceRecorder()
    rec.begin_step("prefill", 96)
    vertical, slash = torch.tensor([[0, 5], [1, 7]], dtype=torch.int32), torch.tensor([[0], [3]], dtype=torch.int32)
    density = torch.tensor([0.5, 0.25], dtype=torch.float64)
    rec.mask_summaries(3, vertical, slash, 96, density)
    rec.mask_summaries(4, None, None, 96, density, images=torch.full((2, 2, 2), 7, dtype=torch.uint8))
    vertical[0, 0], density[1] = 99, 0.0
    masks = rec.end_step().masks
    assert [(m.layer, m.head, m.density) for m in masks] == [(3, 0, 0.5), (3, 1, 0.25), (4, 0, 0.5), (4, 1, 0.25)]
    assert masks[0].vertical.tolist() == [0, 5] and masks[1].slash.tolist() == [3] and masks[0].image is None
    assert masks[2].vertical.dtype == np.int32 and masks[2].vertical.size == 0 and masks[3].image.tolist() == [[7, 7]] * 2


def test_trace_package_imports_without_torch():
    code = "import sys, engine.trace; r = engine.trace.TraceRecorder(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spans_sharing_an_end_stay_nested_after_rounding():
    """Ends are rounded, not durations: a child that ends with its parent never pokes out of it."""
    from engine.trace import COMPUTE, Span, StepTrace, check_chrome_trace, to_chrome_trace
    t0, t_mid, t1 = 2762280.082457942, 2762280.1877606097, 2762315.818736134  # rounded durations: ends 1 ns apart
    spans = [Span(COMPUTE, "layer 14", t0, t1, 14), Span(COMPUTE, "mlp", t_mid, t1, 14)]
    step = StepTrace(0, "decode", 1, t0, t1, spans, [], [], [], {}, "cuda")
    trace = to_chrome_trace([step])
    assert check_chrome_trace(trace) == []
    ends = {e["name"]: e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == COMPUTE}
    assert abs(ends["mlp"] - ends["layer 14"]) < 1e-6

