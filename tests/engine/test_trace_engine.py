"""The engine's own trace: what a generation records, and that the no-op recorder costs nothing."""
import pytest

from engine import SamplingParams
from engine.trace import COMPUTE, HOST, Recorder, TraceRecorder, check_chrome_trace, to_chrome_trace
from engine.trace.recorder import NULL_SPAN


def _nested(spans) -> bool:
    """Spans of one lane nest: sorted by start, each one ends before (or with) every open parent."""
    open_ends = []
    for s in sorted(spans, key=lambda s: (s.t0_us, -s.t1_us)):
        while open_ends and open_ends[-1] <= s.t0_us:
            open_ends.pop()
        if open_ends and s.t1_us > open_ends[-1] + 1e-3:
            return False
        open_ends.append(s.t1_us)
    return True


@pytest.fixture
def recorded(llm):
    rec = TraceRecorder(max_steps=64)
    llm.recorder = rec
    try:
        chunks = list(llm.stream("Name three colours.", SamplingParams(max_tokens=6, ignore_eos=True)))
    finally:
        llm.recorder = None
    return rec, chunks[-1].stats


def test_a_generation_records_well_formed_steps(recorded, llm):
    rec, stats = recorded
    steps = list(rec.steps)
    phases = [s.phase for s in steps]
    assert phases == ["tokenize", "prefill"] + ["decode"] * (stats.completion_tokens - 1)
    prefill = steps[1]
    assert prefill.n_tokens == stats.prompt_tokens - stats.cached_tokens
    assert prefill.metrics["prompt_tokens"] == stats.prompt_tokens
    assert prefill.metrics["kv_blocks_used"] >= 1 and prefill.metrics["mem_kv_used"] > 0
    n_layers = llm.args.num_layers
    for step in steps[1:]:
        for span in step.spans:
            assert span.t1_us >= span.t0_us
            assert step.t0_us - 1e-3 <= span.t0_us and span.t1_us <= step.t1_us + 1e-3
        for lane in (COMPUTE, HOST):
            assert _nested([s for s in step.spans if s.lane == lane])
        layers = [s.layer for s in step.spans if s.lane == COMPUTE and s.name.startswith("layer ")]
        assert layers == list(range(n_layers)), "one compute span per layer per step"
        for name in ("attention", "mlp"):
            assert sorted(s.layer for s in step.spans if s.name == name) == list(range(n_layers))
        assert [s.name for s in step.spans if s.lane == HOST] == ["sample"]


def test_the_exported_trace_passes_the_checker(recorded):
    rec, _ = recorded
    trace = to_chrome_trace(rec.steps)
    assert check_chrome_trace(trace) == []
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "host", "steps"} <= names


class SpyRecorder(Recorder):
    """A no-op recorder that counts the calls a disabled recorder should never get."""

    def __init__(self):
        self.calls = 0

    def _count(self, *a, **k):
        self.calls += 1

    begin_step = end_step = add_span = add_event_span = slot_state = quest_pick = quest_picks = mask_summaries = _count

    def span(self, *a, **k):
        return NULL_SPAN


def test_the_noop_recorder_is_never_asked_to_record(llm):
    spy = SpyRecorder()
    llm.recorder = spy
    try:
        list(llm.stream("Say hi.", SamplingParams(max_tokens=4, ignore_eos=True)))
    finally:
        llm.recorder = None
    assert spy.calls == 0 and not vars(spy).keys() - {"calls"}


def test_a_turn_tokenized_by_its_caller_records_one_tokenize_step_and_answers_the_same(llm):
    """The app and the command line tokenize a turn once (`tokenize_turn`) for the token map and the engine."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = "".join(c.text for c in llm.stream(messages, params))
    rec = TraceRecorder(max_steps=64)
    llm.recorder = rec
    try:
        ids = llm.tokenize_turn(messages)
        chunks = list(llm.stream(messages, params, prompt_ids=ids))
    finally:
        llm.recorder = None
    assert ids == llm.chat_prompt_ids(messages) and "".join(c.text for c in chunks) == plain
    phases = [s.phase for s in rec.steps]
    assert phases.count("tokenize") == 1 and phases[0] == "tokenize" and "prefill" in phases
    assert chunks[-1].stats.prompt_tokens == len(ids)
