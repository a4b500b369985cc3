"""Copy streams and their events, on CUDA and on CPU.

CUDA: a `CopyStream` is a side stream; `copy()` makes it wait for the given events, enqueues the copies
(non_blocking) and returns a CUDA event recorded after them. The compute stream waits for such an event
with `wait_on()` (a GPU-side wait, no host sync).

CPU: a `CopyStream` is one background thread taking jobs in order (a FIFO, like a stream). A job waits for
its events, copies, then sets its own `HostEvent`. torch releases the GIL inside `copy_`, so copies really
overlap the compute on the main thread. "Compute done" on CPU is immediate (the main thread computes
synchronously), so it is the already-set `DONE`.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from engine.trace.events import COMPUTE, Span
from engine.trace.recorder import NULL_RECORDER, Recorder


class HostEvent:
    """A CPU-side event: set by a copy thread when its job is done."""
    __slots__ = ("_done", "error")

    def __init__(self, done: bool = False):
        self._done = threading.Event()
        self.error: BaseException | None = None
        if done:
            self._done.set()

    def set(self) -> None:
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"a KV copy failed: {self.error}") from self.error

    def query(self) -> bool:
        return self._done.is_set()


DONE = HostEvent(done=True)


class WaitedFor:
    """The events one CUDA stream has waited for (or recorded) lately. A second wait for one adds nothing: the
    stream's order keeps all that came after the first wait behind the event. Each wait is a host call of a few
    microseconds, and a layerwise decode step waited ~6 times a layer, mostly for events waited for already (a
    buffer's offload, a layer's last write to the host). Holds the events it saw, so an id is not reused while it
    is here; forgets them all once it holds `size`."""
    __slots__ = ("_held", "size")

    def __init__(self, size: int = 256):
        self._held: dict = {}
        self.size = size

    def first(self, event) -> bool:
        """True if the stream has not waited for `event` yet (it is remembered now: the caller waits)."""
        if self._held.get(id(event)) is event:
            return False
        if len(self._held) >= self.size:
            self._held.clear()
        self._held[id(event)] = event
        return True


class CopyStream:
    def __init__(self, name: str, lane: str, device: torch.device):
        self.name, self.lane, self.device = name, lane, device
        self.cuda = device.type == "cuda"
        self.last_start = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.waited = WaitedFor()       # its own events too: a stream never waits for its own work
        else:
            self.stream = None
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._work, name=f"kvscope-{name}", daemon=True)
            self._thread.start()

    def run(self, fn, after=(), *, recorder: Recorder = NULL_RECORDER, name: str = "gather",
            layer: int | None = None, slot: int | None = None, nbytes: int = 0, compute=None, **args):
        """Run `fn()` (work that moves data, e.g. a gather) on this stream after `after`; -> an end event."""
        return self.copy([(None, fn)], after, recorder=recorder, name=name, layer=layer, slot=slot, nbytes=nbytes,
                         compute=compute, **args)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=(), *, recorder: Recorder = NULL_RECORDER,
             name: str = "copy", layer: int | None = None, slot: int | None = None, nbytes: int = 0, on_done=None,
             compute=None, **args):
        """Copy each (dst, src) after the events in `after` (None entries are skipped); -> an event for the end.
        CPU: `on_done()` runs on the copy thread right after the copies (CUDA: use the returned event).
        CUDA: `compute` is the stream to return to (default: the current one); in a detailed step the copy is a
        span between a mark at its start (`last_start`, for the slot's LOADING state) and the returned event."""
        after = [e for e in after if e is not None]
        if self.cuda:
            s, waited = self.stream, self.waited
            for e in after:
                if waited.first(e):
                    s.wait_event(e)
            # (torch.cuda.current_stream and torch.cuda.stream(s) look the device up: slow per layer)
            prev = compute if compute is not None else torch.cuda.current_stream(s.device)
            self.last_start = start = recorder.mark(s) if recorder.detail else None
            torch.cuda.set_stream(s)
            try:
                for dst, src in pairs:
                    src() if dst is None else dst.copy_(src, non_blocking=True)
            finally:
                torch.cuda.set_stream(prev)
            done = torch.cuda.Event(enable_timing=start is not None)   # the span's end (and the slot's READY)
            done.record(s)
            waited.first(done)
            if start is not None:
                recorder.add_event_span(self.lane, name, start, done, layer, bytes=nbytes, slot=slot, **args)
            return done
        done = HostEvent()
        self._jobs.put((pairs, after, recorder, name, layer, slot, nbytes, args, done, on_done))
        return done

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, after, rec, name, layer, slot, nbytes, args, done, on_done = job
            try:
                for e in after:
                    e.wait()
                with rec.span(self.lane, name, layer, bytes=nbytes, slot=slot, **args):
                    for dst, src in pairs:
                        src() if dst is None else dst.copy_(src)
                if on_done is not None:
                    on_done()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the event
                done.error = e
            done.set()

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
        else:
            marker = HostEvent()
            self._jobs.put(([], [], NULL_RECORDER, "", None, None, 0, {}, marker, None))
            marker.wait()

    def close(self) -> None:
        """CPU: the thread finishes the jobs queued, then ends; this waits for it."""
        if not self.cuda and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


def compute_done(device: torch.device, stream=None):
    """An event marking the compute issued so far (CUDA: recorded on `stream`, default the current one; CPU: done
    already)."""
    if device.type != "cuda":
        return DONE
    e = torch.cuda.Event()
    e.record(stream if stream is not None else torch.cuda.current_stream(device))
    return e


def wait_on(event, device: torch.device, recorder: Recorder = NULL_RECORDER, layer: int | None = None,
            slot: int | None = None, name: str = "wait for copy", stream=None, waited: WaitedFor | None = None):
    """Make the compute stream (`stream`, default the current one) wait for a copy event. In a detailed step the
    wait itself is a span on the compute lane: marks just before and just after the wait bound the time compute
    stalled; on CUDA the one after it is returned (it may time what comes next), else None. `waited`: the events
    that stream has waited for already (CUDA: no second wait for one of them)."""
    if event is None or event is DONE or (waited is not None and not waited.first(event)):
        return
    if device.type == "cuda":
        stream = stream if stream is not None else torch.cuda.current_stream(device)
        if not recorder.detail:
            stream.wait_event(event)
            return
        e0 = recorder.mark(stream)
        stream.wait_event(event)
        e1 = recorder.mark(stream)
        recorder.add_event_span(COMPUTE, name, e0, e1, layer, slot=slot)
        return e1
    if not recorder.detail or event.query():
        event.wait()
        return
    t0 = time.perf_counter_ns()
    event.wait()
    rec_t0 = recorder.now_us() - (time.perf_counter_ns() - t0) / 1e3
    recorder.add_span(Span(COMPUTE, name, rec_t0, recorder.now_us(), layer, 0, slot))
