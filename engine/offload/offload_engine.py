"""OffloadEngine: the only owner of host KV, the device ring, the decode buffer, the copy streams and events.

Every byte of KV that crosses between host and device goes through `load()` or `offload()` here.

Layouts (K and V of a block side by side, heads major inside, so one block of one layer is one contiguous
run of 2*Hkv*bs*D elements and consecutive blocks are consecutive runs: a load of a whole layer whose host
blocks are numbered in order is ONE copy):
    host      [L, host_blocks, 2, Hkv, bs, D]   pinned (pageable with a warning if pinning fails)
    ring slot [slot_blocks, 2, Hkv, bs, D]      on the device; N of them (N = ring depth)
    resident  [slot_blocks, 2, Hkv, bs, D]      on the device, one per layer the residency plan keeps there
    dbuf      [L, 2, Hkv, bs, D]                 on the device: each layer's partly filled last block

Buffers are numbered: ring slots 0..N-1, then resident buffers N, N+1, ... Per buffer: `loaded` (its last
load), `free` (compute done with it) and `read` (its last offload, which reads it). A load into a buffer
waits for `free` and `read` of that buffer and for the last offload of the layer it reads (host blocks are
not read before they are written). The compute stream waits for `loaded` (see streams.wait_on).
"""
from __future__ import annotations

import warnings
import weakref

import torch

from engine.errors import OutOfMemoryError
from engine.offload.streams import CopyStream, WaitedFor, compute_done, wait_on
from engine.trace.events import D2H, FREE, H2D, LOADING, READY
from engine.trace.recorder import NULL_RECORDER, Recorder


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(buffer pos, host block)] -> [(first pos, first block, count)]: runs where both go up by one. The common
    case, one run all the way (a layer's blocks in order), is recognised without a Python loop."""
    if pairs:
        (p0, b0), n = pairs[0], len(pairs)
        if pairs[-1] == (p0 + n - 1, b0 + n - 1) and pairs == list(zip(range(p0, p0 + n), range(b0, b0 + n))):
            return [(p0, b0, n)]
    runs: list[list[int]] = []
    for pos, blk in pairs:
        if runs and pos == runs[-1][0] + runs[-1][2] and blk == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([pos, blk, 1])
    return [tuple(r) for r in runs]


def available_host_memory() -> int | None:
    """Bytes of RAM available (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class OffloadEngine:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, host_blocks: int, ring_slots: int, slot_blocks: int,
                 resident_layers: tuple[int, ...] = ()):
        self.L, self.block_size, self.dtype, self.device = num_layers, block_size, dtype, device
        self.block_shape = (2, num_kv_heads, block_size, head_dim)
        self.block_bytes = 2 * num_kv_heads * block_size * head_dim * dtype.itemsize  # one block of one layer
        self.host_blocks, self.slot_blocks = host_blocks, slot_blocks
        self.recorder: Recorder = NULL_RECORDER   # the running step's (begin_step)
        self.compute = None                       # CUDA: the running step's compute stream (begin_step)
        self.compute_waited = WaitedFor()         # ... and the events it waited for in this step
        self.host = self._allocate_host((num_layers, host_blocks, *self.block_shape))
        try:
            self.buffers = [torch.zeros((slot_blocks, *self.block_shape), dtype=dtype, device=device)
                            for _ in range(ring_slots + len(resident_layers))]
            self.dbuf = torch.zeros((num_layers, *self.block_shape), dtype=dtype, device=device)
        except torch.OutOfMemoryError:
            raise OutOfMemoryError(
                f"the KV ring ({ring_slots} slots) and {len(resident_layers)} resident layers of {slot_blocks} blocks "
                f"({slot_blocks * self.block_bytes / 2**30:.2f} GiB each) do not fit on {device}: lower ring_slots "
                "(--ring-slots), gpu_kv_budget_gb (--gpu-kv-budget) or max_model_len (--max-model-len)") from None
        self.ring_slots = ring_slots
        self.resident = {layer: ring_slots + i for i, layer in enumerate(resident_layers)}
        n = len(self.buffers)
        self.loaded: list = [None] * n     # the buffer's last load
        self._ahead: dict = {}             # buffer -> a deferred `ahead` (CUDA): waited for before the choice
                                           # (or by the buffer's next load, if a stopped step left it)
        self.free: list = [None] * n       # compute done with the buffer
        self.read: list = [None] * n       # the buffer's last offload (it reads the buffer)
        self.held: list[dict] = [{} for _ in range(n)]  # position -> (layer, host block, version) it holds
        self.owner: list = [None] * n                   # the layer whose blocks a buffer holds (None: none)
        self.versions: list[dict] = [{} for _ in range(num_layers)]   # per layer: host block -> times written
        self._rewrites = 0                  # bumped whenever a host block's version changes
        self._same: list = [None] * n       # buffer -> (rewrites, first, blocks) of the `load` it holds whole
        self._plans: dict = {}              # (buffer, layer) -> its last whole load's copies and what it held
        self.layer_written: list = [None] * num_layers  # last offload into each layer's host blocks
        self.dbuf_read: list = [None] * num_layers      # last offload out of each layer's decode buffer
        self.h2d = CopyStream("h2d", H2D, device)
        self.d2h = CopyStream("d2h", D2H, device)
        # CUDA: work fetched one layer ahead has its own stream, so it never queues behind a whole layer's load
        self.h2d_ahead = CopyStream("h2d ahead", H2D, device) if device.type == "cuda" else self.h2d
        self.bytes_h2d = self.bytes_d2h = 0
        self._closed = False

    def _allocate_host(self, shape) -> torch.Tensor:
        nbytes = self.dtype.itemsize
        for d in shape:
            nbytes *= d
        avail = available_host_memory()
        if avail is not None and nbytes > 0.9 * avail:
            raise OutOfMemoryError(
                f"the host KV pool needs {nbytes / 2**30:.1f} GiB ({shape[1]} blocks of {self.block_size} tokens) but "
                f"only {avail / 2**30:.1f} GiB of RAM is available: lower max_model_len (--max-model-len) or "
                "host_kv_gb (--host-kv-gb)")
        host = torch.zeros(shape, dtype=self.dtype)
        if self.device.type != "cuda":
            return host
        # Pin by registering the allocation: torch's pinned allocator rounds sizes up to a power of two (a 72 GiB
        # pool would ask for 128 GiB and fail), cudaHostRegister pins exactly what is there.
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 3)  # portable | mapped
        if int(err) != 0:
            cudart.cudaGetLastError()   # clear it: torch would raise it at its next CUDA call
            warnings.warn(f"could not pin {nbytes / 2**30:.1f} GiB of host memory (CUDA error {int(err)}); using "
                          "pageable memory: host-device copies will be about 3x slower and synchronous", stacklevel=2)
        else:
            self._registered = host
            # close() unregisters; should an engine be dropped unclosed, the registration still goes with it,
            # before its memory is freed (a later pool at the same address could not be pinned otherwise)
            self._unpin = weakref.finalize(self, cudart.cudaHostUnregister, host.data_ptr())
            self._unpin.atexit = False
        return host

    # ---------------------------------------------------------------- views
    def buffer_for(self, layer: int, ring_pos: int | None = None) -> int:
        """The buffer a layer computes in: its resident buffer, or ring slot `ring_pos % N`."""
        return self.resident[layer] if layer in self.resident else ring_pos % self.ring_slots

    def kv_views(self, buf: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a buffer as [blocks, offset, head, dim] views (what the paged attention ops take)."""
        b = self.buffers[buf]
        return b[:, 0].transpose(1, 2), b[:, 1].transpose(1, 2)

    @property
    def capacity_tokens(self) -> int:
        return self.slot_blocks * self.block_size

    # ---------------------------------------------------------------- copies
    def begin_step(self, recorder: Recorder) -> None:
        """A step starts: the recorder it reports to, and (CUDA) its compute stream, looked up once."""
        self.recorder = recorder
        self.compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.compute_waited = WaitedFor()

    def load(self, buf: int, layer: int, host_blocks: list[int], first: int = 0, **trace) -> None:
        """Host blocks of `layer` -> buffer positions first, first+1, ... (H2D stream, async). Positions that
        already hold the current version of their block (a resident layer, a slot loaded before) are skipped."""
        held, ver, n, blocks = self.held[buf], self.versions[layer], len(host_blocks), tuple(host_blocks)
        same = self._same[buf]
        if self.owner[buf] == layer and same is not None and same[0] == self._rewrites and same[1] == first \
                and same[2] == blocks:         # a resident layer at decode: held as loaded last time (no loop)
            return
        self._same[buf] = (self._rewrites, first, blocks)
        if self.owner[buf] == layer:           # some positions may hold these blocks already
            need = []
            for i, b in enumerate(host_blocks):
                key = (layer, b, ver.get(b, 0))
                if held.get(first + i) != key:
                    held[first + i] = key
                    need.append((first + i, b))
            runs = block_runs(need)
            pairs = self._pairs(buf, layer, runs)
        else:                                  # another layer's blocks (a ring slot): all of them, as planned before
            need = host_blocks
            self.owner[buf] = layer
            pairs, self.held[buf] = self._whole_load(buf, layer, first, blocks)
        if not need:
            return
        rec = self.recorder
        nbytes = len(need) * self.block_bytes
        slot = buf if buf < self.ring_slots else None
        ready = None
        cuda = self.device.type == "cuda"
        trace_slot = rec.detail and slot is not None
        if trace_slot:
            tokens, cap = (first + n) * self.block_size, self.capacity_tokens
            if not cuda:
                rec.slot_state(slot, layer, LOADING, first * self.block_size, cap)
                ready = lambda: rec.slot_state(slot, layer, READY, tokens, cap)  # noqa: E731 - on the copy thread
        self.loaded[buf] = self.h2d.copy(pairs, (self.free[buf], self.read[buf], self.loaded[buf],
                                                 self.layer_written[layer], self._ahead.pop(buf, None)),
                                         recorder=rec, name=f"load L{layer}", layer=layer, slot=slot, nbytes=nbytes,
                                         on_done=ready, compute=self.compute, blocks=len(need), copies=len(pairs),
                                         **trace)
        if trace_slot and cuda:                # the copy's own start mark and end event time the states
            rec.slot_state(slot, layer, LOADING, first * self.block_size, cap, event=self.h2d.last_start)
            rec.slot_state(slot, layer, READY, tokens, cap, event=self.loaded[buf])
        self.bytes_h2d += nbytes

    def _pairs(self, buf: int, layer: int, runs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(buffer view, host view) per run of (first pos, first block, count)."""
        dst = self.buffers[buf]
        return [(dst[p:p + k], self.host[layer, b:b + k]) for p, b, k in runs]

    def _whole_load(self, buf: int, layer: int, first: int, blocks: tuple) -> tuple[list, dict]:
        """A whole load's copies and what the buffer then holds (a new dict), kept per (buffer, layer) while its
        blocks and the host's writes stay the same: a decode step loads the same blocks of a layer into the same slot
        as the step before until a block fills (every block_size steps), and making the views and the dict again
        each time was a third of the layer's host time (layerwise decode on CUDA, where the host loop sets the pace
        of a small model)."""
        plan = self._plans.get((buf, layer))
        if plan is None or plan[0] != (first, blocks, self._rewrites):
            ver = self.versions[layer]
            pairs = self._pairs(buf, layer, block_runs(list(zip(range(first, first + len(blocks)), blocks))))
            plan = self._plans[buf, layer] = ((first, blocks, self._rewrites), pairs,
                                              {first + i: (layer, b, ver.get(b, 0)) for i, b in enumerate(blocks)})
        return plan[1], dict(plan[2])

    def load_rows(self, buf: int, layer: int, rows: torch.Tensor, moved: int | None = None, **trace) -> None:
        """Per-kv-head tokens of `layer` -> packed into the buffer: rows[h, j] (a host-pool token, block *
        block_size + offset) lands at token j of head h, so each head attends to its own selection through one
        block table. One gather per load, never a copy per token or page: on CUDA a Triton kernel reads the pinned
        pool over PCIe through its device mapping (engine/ops/triton_gather.py); on CPU the copy thread indexes."""
        from engine.ops.triton_gather import gather_rows, gather_rows_reference
        hkv, n = rows.shape
        two, _, bs, d = self.block_shape
        cuda = self.device.type == "cuda"
        src = self._source(layer)
        dst = self.buffers[buf]
        rows = rows.to(dst.device, non_blocking=True)
        if cuda:  # made on the compute stream, used on the copy stream: keep it alive there
            rows.record_stream(self.h2d.stream)
        gather = gather_rows if cuda else gather_rows_reference
        self.packing(buf)
        nbytes = hkv * (n if moved is None else moved) * two * d * self.dtype.itemsize   # moved: rows not -1
        slot = buf if buf < self.ring_slots else None
        self.loaded[buf] = self.h2d.run(lambda: gather(src, dst, rows),
                                        (self.free[buf], self.read[buf], self.loaded[buf], self.layer_written[layer],
                                         compute_done(self.device, self.compute), self._ahead.pop(buf, None)),
                                        recorder=self.recorder, name=f"load L{layer} rows", layer=layer, slot=slot,
                                        nbytes=nbytes, compute=self.compute, tokens=n, **trace)
        self.bytes_h2d += nbytes

    def packing(self, buf: int) -> None:
        """The buffer is about to hold packed rows (load_rows, or rows placed by compute): no whole blocks."""
        self.held[buf], self.owner[buf], self._same[buf] = {}, None, None

    def fix_rows(self, buf: int, layer: int, rows: torch.Tensor, dst_rows: torch.Tensor, ahead: bool = False) -> None:
        """Host-pool rows -> packed positions dst_rows of a loaded buffer, on the compute stream (a correction
        right before attention; rows of -1 are skipped), or `ahead` (a fetch on the copy stream, fewer programs).
        How many it moved is known on the device only: the policy counts them (Quest's `quest_fetched`) and the
        runner adds their bytes after the step."""
        from engine.ops.triton_gather import AHEAD_PROGRAMS, FIX_PROGRAMS, gather_rows, gather_rows_reference
        if self.device.type == "cuda":
            programs = AHEAD_PROGRAMS if ahead else FIX_PROGRAMS
            gather_rows(self._source(layer), self.buffers[buf], rows, dst_rows, programs)
        else:
            gather_rows_reference(self._source(layer), self.buffers[buf], rows, dst_rows)

    def fetch_rows(self, buf: int, layer: int, rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """`fix_rows` on the copy stream, after the compute issued so far (which made rows and dst_rows) and the
        buffer's load: a correction made ahead of the layer that reads the buffer (it waits for it)."""
        self.ahead(buf, layer, lambda: self.fix_rows(buf, layer, rows, dst_rows, ahead=True))

    def ahead(self, buf: int, layer: int, work, defer: bool = False) -> None:
        """`work()` on the copy stream (CUDA: the current stream while it runs), after the compute issued so far
        and the buffer's load; the layer that reads the buffer waits for it: with its loads, or with `defer` at
        `wait_ahead` (before the layer's own choice: its q, k, v need only the loads). E.g. a choice made from a
        guessed query and the gather of what it chose, one graph replay (engine/sparse/quest.py `observe_ahead`)."""
        done = self.h2d_ahead.run(work, (self.loaded[buf], compute_done(self.device, self.compute)),
                                  recorder=self.recorder, name=f"fetch L{layer} rows ahead", layer=layer,
                                  slot=buf if buf < self.ring_slots else None, compute=self.compute)
        if defer:
            self._ahead[buf] = done
        else:
            self.loaded[buf] = done

    def wait_ahead(self, buf: int, recorder=None, layer: int | None = None) -> bool:
        """The compute stream waits for the buffer's deferred `ahead` work, if any (True when there was some)."""
        done = self._ahead.pop(buf, None)
        if done is not None:
            wait_on(done, self.device, recorder or self.recorder, layer, buf if buf < self.ring_slots else None,
                    name="wait for the fetch ahead", stream=self.compute)
        return done is not None

    def _source(self, layer: int) -> torch.Tensor:
        """One layer of the host pool as kernels read it: on CUDA through the pool's device mapping."""
        return (self._device_view() if self.device.type == "cuda" else self.host)[layer]

    def _device_view(self) -> torch.Tensor:
        """A CUDA tensor over the registered (pinned, mapped) host pool: kernels read it over PCIe."""
        if getattr(self, "_uva", None) is None:
            if getattr(self, "_registered", None) is None:
                raise RuntimeError("page gathers on CUDA need the pinned host pool, and pinning failed")
            iface = {"shape": tuple(self.host.shape), "typestr": "<i2" if self.dtype.itemsize == 2 else "<f4",
                     "data": (self.host.data_ptr(), False), "version": 3, "strides": None}
            holder = type("HostPool", (), {"__cuda_array_interface__": iface})()
            self._uva = torch.as_tensor(holder, device=self.device).view(self.dtype)
        return self._uva

    def writing(self, buf: int, first: int) -> None:
        """Compute is about to write positions >= first of a buffer: they no longer hold host blocks."""
        held = self.held[buf]
        if held and max(held) >= first:
            for p in [p for p in held if p >= first]:
                del held[p]
            self._same[buf] = None

    def ready(self, buf: int) -> tuple:
        """Events compute must wait for before using a buffer: its loads landed, its offloads read it."""
        return self.loaded[buf], self.read[buf]

    def offload(self, buf: int, layer: int, positions: list[int], host_blocks: list[int], **trace) -> None:
        """Buffer positions -> host blocks of `layer` (D2H stream, async, after the compute issued so far)."""
        self._offload(self.buffers[buf], buf, layer, positions, host_blocks, trace)

    def offload_dbuf(self, layer: int, host_block: int, **trace) -> None:
        """The layer's decode-buffer block (now full) -> a host block."""
        self._offload(self.dbuf[layer:layer + 1], None, layer, [0], [host_block], trace)

    def _offload(self, src, buf, layer, positions, host_blocks, trace) -> None:
        if not host_blocks:
            return
        pairs = [(self.host[layer, b:b + n], src[p:p + n]) for p, b, n in block_runs(list(zip(positions, host_blocks)))]
        nbytes = len(host_blocks) * self.block_bytes
        slot = buf if buf is not None and buf < self.ring_slots else None
        done = self.d2h.copy(pairs, (compute_done(self.device, self.compute),), recorder=self.recorder,
                             name=f"offload L{layer}", layer=layer, slot=slot, nbytes=nbytes, compute=self.compute,
                             blocks=len(host_blocks), copies=len(pairs), **trace)
        self.layer_written[layer] = done
        self._rewrites += 1
        ver = self.versions[layer]
        if buf is not None and self.owner[buf] != layer:   # what it held of another layer is of no use now
            self.held[buf].clear()
            self.owner[buf] = layer
        for p, b in zip(positions, host_blocks):
            v = ver[b] = ver.get(b, 0) + 1
            if buf is not None:
                self.held[buf][p] = (layer, b, v)
        if buf is not None:
            self.read[buf] = done
        else:
            self.dbuf_read[layer] = done
        self.bytes_d2h += nbytes

    def release(self, buf: int, layer: int, tokens: int, event=None) -> None:
        """Compute is done with a buffer (for now): later loads into it may start. `event`: a mark of the compute
        stream to time the slot's FREE state by (default: a new one)."""
        self.free[buf] = compute_done(self.device, self.compute)
        rec = self.recorder
        if rec.detail and buf < self.ring_slots:
            rec.slot_state(buf, layer, FREE, tokens, self.capacity_tokens, event=event)

    # ---------------------------------------------------------------- whole-step graphs (step_graphs.py)
    def pending(self) -> list:
        """Every copy event a step may have to wait for: loads, offloads, fetches ahead."""
        return [e for e in (*self.loaded, *self.read, *self.dbuf_read, *self.layer_written, *self._ahead.values())
                if e is not None]

    def holdings(self) -> list[tuple]:
        """What each buffer holds, as (owner layer, {position: (layer, host block, version)}, whole-load key)."""
        return [(o, dict(h), s) for o, h, s in zip(self.owner, self.held, self._same)]

    def hold(self, holdings: list[tuple], done) -> None:
        """The buffers hold `holdings`, and every copy and compute so far ended at `done` (a compute-stream event
        recorded after a step graph's replay; None: no event, while a step graph is recorded)."""
        for b, (o, h, s) in enumerate(holdings):
            self.owner[b], self.held[b], self._same[b] = o, dict(h), s
        self.loaded = [None if e is None else done for e in self.loaded]
        self.free = [done] * len(self.free)
        self.read = [None] * len(self.read)
        self.dbuf_read = [None] * self.L
        self.layer_written = [None] * self.L

    def host_written(self, host_blocks: list[int]) -> None:
        """These host blocks were written from outside (the disk tier): a buffer holding an older version of one
        of them loads it again."""
        self._rewrites += 1
        for ver in self.versions:
            for b in host_blocks:
                ver[b] = ver.get(b, 0) + 1

    def synchronize(self) -> None:
        """Wait for every copy issued so far (both directions)."""
        self.h2d.synchronize()
        self.h2d_ahead.synchronize()
        self.d2h.synchronize()

    def close(self) -> None:
        """Finish the copies, join the copy threads, unpin the host pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.device.type == "cuda":  # copies in flight must land before the pool is unpinned
            self.synchronize()
        self.h2d.close()
        self.d2h.close()
        self._plans.clear()               # (views of the pool)
        if getattr(self, "_registered", None) is not None:
            self._unpin()                 # cudaHostUnregister, once
            self._registered = None
