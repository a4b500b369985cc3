"""The offload engine's host-side bookkeeping of copies: which waits a CUDA stream is given (a fake torch.cuda on
the CPU) and what a ring slot holds after loads planned once and reused (the real copy threads)."""
import torch

from engine.offload.offload_engine import OffloadEngine
from engine.offload.streams import CopyStream, WaitedFor, wait_on
from engine.trace.events import H2D


class FakeStream:
    def __init__(self, device=None):
        self.device, self.waits = device, []

    def wait_event(self, event):
        self.waits.append(event)


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.stream = None

    def record(self, stream):
        self.stream = stream


def _fake_cuda(monkeypatch) -> FakeStream:
    main = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    return main


def test_a_copy_stream_waits_for_each_event_once_and_never_for_its_own_copies(monkeypatch):
    main = _fake_cuda(monkeypatch)
    h2d = CopyStream("h2d", H2D, torch.device("cuda"))
    offload = FakeEvent()
    offload.record(main)
    first = h2d.copy([], (offload, None))
    assert first.stream is h2d.stream and h2d.stream.waits == [offload]
    second = h2d.copy([], (offload, first))            # waited for already / recorded on this stream
    assert h2d.stream.waits == [offload]
    freed = FakeEvent()
    freed.record(main)
    h2d.copy([], (freed, second, offload))             # a new event is waited for
    assert h2d.stream.waits == [offload, freed]


def test_the_compute_stream_waits_once_for_an_event_in_a_step(monkeypatch):
    _fake_cuda(monkeypatch)
    compute, loaded, waited = FakeStream(), FakeEvent(), WaitedFor()
    cuda = torch.device("cuda")
    for _ in range(3):
        wait_on(loaded, cuda, stream=compute, waited=waited)
    wait_on(loaded, cuda, stream=compute)              # without the step's record: always
    assert compute.waits == [loaded, loaded]


def test_waited_for_holds_what_it_saw_and_forgets_all_when_full():
    w = WaitedFor(size=3)
    events = [object() for _ in range(4)]
    assert [w.first(e) for e in events[:3]] == [True] * 3
    assert not w.first(events[1])
    assert w.first(events[3])                           # full: it forgets, then remembers this one
    assert w.first(events[0]) and not w.first(events[3])


def test_a_ring_slot_given_the_same_layers_again_holds_the_host_pool_as_it_is_now():
    """Whole loads into a ring slot are planned once per (slot, layer, blocks, host writes) and reused: the data
    is still the pool's current data after a block was written, and what one load holds is its own."""
    oe = OffloadEngine(2, 2, 4, 4, torch.float32, torch.device("cpu"), host_blocks=6, ring_slots=1, slot_blocks=4)
    try:
        oe.host.copy_(torch.randn_like(oe.host))

        def load(layer, blocks):
            before = oe.bytes_h2d
            oe.load(0, layer, blocks)
            oe.synchronize()
            assert torch.equal(oe.buffers[0][:len(blocks)], oe.host[layer, blocks])
            return (oe.bytes_h2d - before) // oe.block_bytes

        for _ in range(2):                               # the second round reuses the plans of the first
            assert load(0, [1, 2, 4]) == 3
            assert load(1, [0, 3]) == 2
        oe.writing(0, 1)                                 # compute overwrote position 1 of layer 1's load
        assert load(0, [1, 2, 4]) == 3
        assert oe.held[0] == {0: (0, 1, 0), 1: (0, 2, 0), 2: (0, 4, 0)}    # the plan's record, not the edited one
        oe.host[0, 2] += 1.0
        oe.host_written([2])
        assert load(1, [0, 3]) == 2
        assert load(0, [1, 2, 4]) == 3                   # planned again: the rewritten block's new data
        assert oe.held[0][1] == (0, 2, 1)
    finally:
        oe.close()
