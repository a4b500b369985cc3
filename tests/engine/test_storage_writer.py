"""The KV page store's background writer: each tag acknowledged once, a key written once, backpressure, pages it
cannot write, and queued writes finishing at interpreter exit."""
import os
import sys
import threading

import pytest
import torch

from engine.offload.storage import KVStore, PageFormat
from engine.offload.store_writer import StoreWriter
from tests.engine.storage_pages import BIG_LAYOUT, FMT, LAYOUT, key, page, run_python


def test_writer_writes_and_acknowledges_each_tag_once(tmp_path):
    store = KVStore(tmp_path, FMT, 1 << 20)
    writer = StoreWriter(store)
    host = torch.stack([page(i) for i in range(6)], dim=1)  # [L, blocks, ...]: strided pages
    for i in range(6):
        writer.submit(key(i), host[:, i], ("block", i))
    assert writer.flush(timeout=30)
    assert writer.pending == 0
    assert sorted(writer.acks()) == [("block", i) for i in range(6)]
    assert writer.acks() == []
    out = torch.empty(LAYOUT)
    for i in range(6):
        assert store.read(key(i), out) and torch.equal(out, page(i))
    writer.close()
    writer.close()  # idempotent
    writer.submit(key(9), page(9), "late")  # after close: acknowledged, not written
    assert writer.acks() == ["late"] and not store.contains(key(9))


def test_writer_writes_a_key_once(tmp_path):
    store = KVStore(tmp_path, FMT, 1 << 20)
    writer = StoreWriter(store)
    writer.submit(key(0), page(0), "first")
    writer.submit(key(0), page(1), "second")  # same key: already on disk when its turn comes
    assert writer.flush(timeout=30)
    assert sorted(writer.acks()) == ["first", "second"]
    out = torch.empty(LAYOUT)
    assert store.read(key(0), out) and torch.equal(out, page(0))
    assert store.usage()[0] == 1
    writer.close()


def test_writer_pending_backpressure_and_flush_timeout(tmp_path, monkeypatch):
    store = KVStore(tmp_path, FMT, 1 << 20)
    gate = threading.Event()
    write = store.write
    monkeypatch.setattr(store, "write", lambda k, p: gate.wait() and write(k, p))
    writer = StoreWriter(store, max_pending=1)
    writer.submit(key(0), page(0), 0)
    writer.submit(key(1), page(1), 1)  # queued behind the write held at the gate
    third = threading.Thread(target=writer.submit, args=(key(2), page(2), 2))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # the queue is full: submit blocks
    assert writer.pending >= 2 and writer.acks() == []
    assert writer.flush(timeout=0.05) is False
    gate.set()
    third.join(30)
    assert not third.is_alive()
    assert writer.flush(timeout=30) and writer.pending == 0
    assert sorted(writer.acks()) == [0, 1, 2]
    assert all(store.contains(key(i)) for i in range(3))
    writer.close()


@pytest.mark.filterwarnings("ignore:KV page store")
def test_writer_acknowledges_a_page_it_cannot_write(tmp_path):
    store = KVStore(tmp_path, FMT, 1 << 20)
    writer = StoreWriter(store)
    writer.submit(key(0), torch.zeros(3), "bad shape")
    writer.submit(key(1), page(1), "good")
    assert writer.flush(timeout=30)
    assert sorted(writer.acks()) == ["bad shape", "good"]
    assert not store.contains(key(0)) and store.contains(key(1))
    writer.close()


_EXITING_WRITER = """
import sys, torch
from engine.offload.storage import KVStore, PageFormat
from engine.offload.store_writer import StoreWriter
layout = {layout}
writer = StoreWriter(KVStore(sys.argv[1], PageFormat("exit-test", "float32", layout), 1 << 30))
for i in range(12):
    writer.submit(f"{{i:032x}}", (torch.arange(2 ** 19, dtype=torch.float32) + i).view(layout), i)
"""


def test_queued_writes_finish_at_interpreter_exit(tmp_path):
    proc = run_python(_EXITING_WRITER.format(layout=BIG_LAYOUT), str(tmp_path))
    assert proc.wait(timeout=120) == 0
    store = KVStore(tmp_path, PageFormat("exit-test", "float32", BIG_LAYOUT), 1 << 30)
    out = torch.empty(BIG_LAYOUT)
    for i in range(12):
        assert store.read(f"{i:032x}", out)
        assert torch.equal(out, torch.arange(2 ** 19, dtype=torch.float32).view(BIG_LAYOUT) + i)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_pages_of_every_dtype_round_trip_through_the_writer(tmp_path, dtype):
    """The writer copies a CPU page with numpy (a torch copy on its thread started an OpenMP team beside the engine's,
    which slowed a CPU engine's decode 1.5x while the thread lived): bfloat16 too, which numpy has no type for."""
    fmt = PageFormat("tiny-model", dtype, LAYOUT)
    store = KVStore(tmp_path, fmt, 1 << 20)
    writer = StoreWriter(store)
    host = torch.stack([page(i) for i in range(3)], dim=1).to(getattr(torch, dtype))   # [L, blocks, ...]: strided
    for i in range(3):
        writer.submit(key(i), host[:, i], i)
    assert writer.flush(timeout=30) and sorted(writer.acks()) == [0, 1, 2]
    out = torch.empty(LAYOUT, dtype=getattr(torch, dtype))
    for i in range(3):
        assert store.read(key(i), out) and torch.equal(out, host[:, i])
    writer.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is a Linux feature")
def test_the_writer_thread_yields_the_cpu_to_the_engine(tmp_path):
    """Writing a new document's pages took a core from a CPU engine on every core (2-core CPU: its first decode steps
    355 ms against 56): the writer's thread runs at the lowest priority, so the pages go to disk when a core is idle."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = StoreWriter(KVStore(tmp_path, FMT, 1 << 20))
    writer.submit(key(0), page(0), 0)
    assert writer.flush(timeout=30)
    assert os.getpriority(os.PRIO_PROCESS, writer._thread.native_id) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine     # the engine's thread keeps its own
    writer.close()
