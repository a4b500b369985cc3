"""engine.trace's CUDA path: the recorder's event timing with a fake torch.cuda on the CPU (one sync a step, spans
on their streams' clocks), and once with real events on the device."""
import time

import pytest
import torch

from engine.trace import COMPUTE, H2D, HOST, TraceRecorder, check_chrome_trace, to_chrome_trace


class FakeCuda:
    """Just enough of torch.cuda for the recorder's CUDA path: an event's GPU time is the host time of its
    record() plus its stream's lag (the GPU running behind the host); synchronize() is counted."""

    class Event:
        reads = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream):
            self.t = time.perf_counter_ns() + stream.lag_ns

        def synchronize(self):
            pass

        def query(self):   # done once the host clock passes its time (a recorded event, never one not recorded)
            return self.t is None or time.perf_counter_ns() >= self.t

        def elapsed_time(self, end):
            type(self).reads += 1
            if self.t is None or end.t is None:
                raise RuntimeError("event not recorded")
            return (end.t - self.t) / 1e6

    class Stream:
        def __init__(self, lag_ns):
            self.lag_ns = lag_ns

    class nvtx:
        depth = 0

        @classmethod
        def range_push(cls, name):
            cls.depth += 1

        @classmethod
        def range_pop(cls):
            cls.depth -= 1

    def __init__(self):
        self.main, self.syncs, self.created = self.Stream(0), 0, 0
        real = self.Event

        def event(**kw):
            self.created += 1
            return real(**kw)
        self.Event = event

    def current_stream(self, device=None):
        return self.main

    def synchronize(self, device=None):
        self.syncs += 1


def test_cuda_path_with_fake_events():
    rec = TraceRecorder(device=torch.device("cuda"))
    fake = FakeCuda()
    rec._torch = type("FakeTorch", (), {"cuda": fake})
    rec._nvtx = fake.nvtx
    side = fake.Stream(lag_ns=2_000_000)  # the side stream's work ends 2 ms after the host enqueued it
    for n in range(3):
        rec.begin_step("decode", 1)
        with rec.span(H2D, "load", 0, stream=side, bytes=4096):
            pass
        with rec.span(COMPUTE, "layer", 0):
            time.sleep(0.0005)
        with rec.span(HOST, "sample"):           # the host lane uses the host clock, no events
            pass
        e0, e1 = fake.Event(enable_timing=True), fake.Event(enable_timing=True)
        e0.record(fake.main)
        e1.record(fake.main)
        rec.add_event_span(COMPUTE, "graph", e0, e1)
        rec.add_event_span(COMPUTE, "never ran", fake.Event(enable_timing=True), e1)  # dropped
        rec.slot_state(0, 0, "ready", 16, 16, stream=side)
        step = rec.end_step()
        assert fake.syncs == n + 1 and fake.nvtx.depth == 0
    assert [s.name for s in step.spans] == ["layer", "graph", "load", "sample"]
    assert all(step.t0_us <= s.t0_us <= s.t1_us <= step.t1_us for s in step.spans)
    load, layer = step.lane_spans(H2D)[0], step.lane_spans(COMPUTE)[0]
    assert load.t0_us - layer.t0_us == pytest.approx(2000 - 0, abs=600)  # the side stream's lag shows
    assert layer.dur_us >= 500 and step.slots[0].t_us > layer.t1_us
    # timing events are pooled: later steps create only the caller's own ones
    assert fake.created == 7 + 3 * 3  # 7 of the recorder's (start, 2 spans, slot, end), 3 of the caller's a step

    # deferred: no sync at end_step; the step appears when resolved (by the next end_step at the latest), in order
    rec.begin_step("decode", 1)
    with rec.span(COMPUTE, "layer", 0):
        pass
    assert rec.end_step({"k": 1}, defer=True) is None and fake.syncs == 3
    assert fake.nvtx.depth == 0                  # a step's NVTX range ends with the step, not when it is read
    rec.begin_step("decode", 1)
    rec.end_step({"k": 2}, defer=True)
    assert [s.metrics.get("k") for s in list(rec.steps)[-2:]] == [None, 1]
    assert rec.flush().metrics == {"k": 2} and rec.flush() is None and fake.syncs == 3
    rec._detail_every_us = 1e12                  # decode steps without a timeline (the app's between redraws)
    for _ in range(3):
        rec.begin_step("decode", 1)
        assert not rec.detail and fake.nvtx.depth == 1
        rec.end_step(defer=True)
        assert fake.nvtx.depth == 0
    assert rec.flush() is not None and fake.nvtx.depth == 0
    rec.begin_step("prefill", 160)               # a step of parts (chunks) at a detail rate: 3 of them timed
    reads = FakeCuda.Event.reads
    for i in range(5):
        rec.begin_part(i, 5)
        if i == 0:
            host0 = time.perf_counter_ns()
        with rec.span(COMPUTE, f"chunk {i}", 0):
            time.sleep(0.0002)
        if i == 0:                               # a copy for a later chunk, done 2 ms after it was issued
            with rec.span(H2D, "load ahead", 0, stream=side):
                pass
            host_us = (time.perf_counter_ns() - host0) / 1e3   # the host's time from chunk 0 to the copy
    read_while_running = FakeCuda.Event.reads - reads
    step = rec.end_step()
    assert step.metrics == {"parts": 5.0, "parts_detailed": 3.0} and step.detailed
    assert [s.name for s in step.spans] == ["chunk 0", "chunk 2", "chunk 3", "load ahead"]   # not the last one
    for (w0, w1), s in zip(step.windows, step.spans):   # resolved from their marks like any span
        assert step.t0_us <= w0 <= s.t0_us < s.t1_us <= w1 <= step.t1_us
    assert 2000 + 200 <= step.spans[-1].t0_us - step.spans[0].t0_us <= 2000 + host_us   # the side stream's lag
    # the done parts' events were read while the step ran (the three chunks': two marks each), the copy's only after
    assert read_while_running >= 6 and FakeCuda.Event.reads - reads > read_while_running
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_event_timing_one_sync(monkeypatch):
    dev = torch.device("cuda")
    rec = TraceRecorder(device=dev)
    a = torch.randn(2048, 2048, device=dev)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    syncs = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (syncs.append(1), real(*a, **k))[1])
    rec.begin_step("prefill", 2048)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), rec.span(H2D, "side matmul", 0, stream=side, bytes=a.nbytes):
        b = a @ a
    with rec.span(COMPUTE, "main matmul", 0):
        c = a @ a
    rec.slot_state(0, 0, "ready", 16, 16)
    with rec.span(HOST, "host work"):
        time.sleep(0.001)
    torch.cuda.current_stream().wait_stream(side)
    step = rec.end_step()
    assert len(syncs) == 1
    assert {s.name for s in step.spans} == {"side matmul", "main matmul", "host work"}
    assert all(step.t0_us <= s.t0_us < s.t1_us <= step.t1_us + 1 for s in step.spans)
    assert step.slots and step.t0_us <= step.slots[0].t_us <= step.t1_us + 1
    assert check_chrome_trace(to_chrome_trace([step])) == []
    del b, c


def test_an_event_read_mid_step_and_freed_lends_its_time_to_no_later_event():
    """The step's clock reads the records whose events completed while the step runs (`settle`). A copy's end event
    is not the recorder's: once read it may be freed, and a new event can take its address. Every span must keep its
    own events' times (a chunked prefill's MLP once ended after its layer, 3 ms later than it ran)."""
    from engine.trace.event_clock import EventClock
    Event, stream = FakeCuda.Event, FakeCuda.Stream(0)
    start = Event(enable_timing=True)
    start.record(stream)
    clock = EventClock(start)
    for i in range(20):                              # copies read while the step runs, then dropped by their owner
        a, b = Event(enable_timing=True), Event(enable_timing=True)
        a.record(stream)
        time.sleep(0.0002)
        b.record(stream)
        assert clock.settle([("h2d", f"copy {i}", 0, 0, None, None, a, b)], []) == ([], [])
        del a, b
    time.sleep(0.002)
    late = []
    for i in range(20):                              # spans recorded later in the step, read at its end
        a, b = Event(enable_timing=True), Event(enable_timing=True)
        a.record(stream)
        b.record(stream)
        late.append(("compute", f"late {i}", 0, 0, None, None, a, b))
    end = Event(enable_timing=True)
    end.record(stream)
    clock.finish(end, 0.0, late, [], None)
    copies = [s for s in clock.spans if s.name.startswith("copy")]
    later = [s for s in clock.spans if s.name.startswith("late")]
    assert len(copies) == len(later) == 20
    assert min(s.t0_us for s in later) >= max(s.t1_us for s in copies) + 1500   # 2 ms later, every one of them
