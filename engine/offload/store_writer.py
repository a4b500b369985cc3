"""StoreWriter: writes KV pages to the disk store (engine/offload/storage.py) on a background thread and
acknowledges every page, so the engine knows when the host block it keeps unchanged for the write may be reused."""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import warnings

import torch

from engine.offload.storage import KVStore


def _yield_to_the_engine() -> None:
    """Linux: this thread at the lowest priority (nice 19; a thread's own, raising it needs no privilege). Writing a
    new document's pages (the default model: 22 pages of 12 MB for the 5.8K-token sample) took a core from a CPU
    engine that computes on every core, whose steps then waited for it at each parallel op's barrier (2-core CPU: the
    first decode steps 355 ms against 56); at this priority the pages are written when the engine leaves a core idle
    (between turns, or on a GPU host's other cores), and nothing waits for them (the queue is unbounded)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class StoreWriter:
    """Background writer thread with acknowledgements.

    submit() queues (key, page, tag); the caller keeps the page's memory unchanged until acks() has returned
    the tag. Every tag comes back exactly once: written, already on disk, or not written (store off, error).
    """

    def __init__(self, store: KVStore, max_pending: int = 256):   # max_pending 0: unbounded
        self.store = store
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._done = threading.Condition()  # guards _acks, _pending, _closed
        self._acks: list = []
        self._pending = 0
        self._closed = False
        self._stream = None  # the writer's CUDA stream, made at the first device page
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # queued pages still reach the disk at interpreter exit

    @property
    def pending(self) -> int:
        """Pages submitted and not yet done (queued or being written)."""
        with self._done:
            return self._pending

    def submit(self, key: str, page: torch.Tensor, tag) -> None:
        """Queue a write; blocks while max_pending writes wait. A closed writer or disabled store acks at once."""
        with self._done:
            if self._closed or not self.store.enabled:
                self._acks.append(tag)
                return
            self._pending += 1
        self._queue.put((key, page, tag))

    def _ack(self, tag) -> None:
        with self._done:
            self._acks.append(tag)
            self._pending -= 1
            self._done.notify_all()

    def _run(self) -> None:
        _yield_to_the_engine()
        while (item := self._queue.get()) is not None:
            key, page, tag = item
            try:
                with self._side_stream(page):    # a device page's copy out does not queue behind the engine's kernels
                    self.store.write(key, page)
            except Exception as e:  # noqa: BLE001 - a bad page must not stall the engine: it is still acked
                warnings.warn(f"KV page store: page {key} was not written ({e})", stacklevel=1)
            item = page = None  # the caller may reuse the memory once acknowledged
            self._ack(tag)

    def _side_stream(self, page: torch.Tensor):
        """A CUDA page is copied to the host on the writer's own stream (the caller synchronised before submit)."""
        if not page.is_cuda:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=page.device)
        return torch.cuda.stream(self._stream)

    def acks(self) -> list:
        """Tags whose writes finished since the last call (non-blocking)."""
        with self._done:
            tags, self._acks = self._acks, []
        return tags

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if the timeout came first."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish the queued writes and stop the thread (idempotent)."""
        with self._done:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._thread.join()
        while not self._queue.empty():  # a submit racing with close() came after the stop: ack it unwritten
            if (item := self._queue.get()) is not None:
                self._ack(item[2])
