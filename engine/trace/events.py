"""What the engine records: plain dataclasses (numpy arrays allowed, never torch tensors).

All times are microseconds since the recorder was created (one time base for every step, host and GPU alike),
so spans of different steps and lanes can be drawn on one axis. The widgets draw these without importing torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Lanes (tracks) in display order.
COMPUTE = "compute"   # kernels on the compute stream
H2D = "h2d"           # host-to-device copies (KV loads)
D2H = "d2h"           # device-to-host copies (KV offload)
HOST = "host"         # CPU work: scheduling, tokenizing, sampling, host-side memcpy
LANES = (COMPUTE, H2D, D2H, HOST)
COPY_LANES = (H2D, D2H)

# States of a GPU ring slot (one slot holds one layer's KV while it is used).
FREE = "free"
LOADING = "loading"
READY = "ready"
COMPUTING = "computing"
SLOT_STATES = (FREE, LOADING, READY, COMPUTING)

# Phases of a step.
PREFILL = "prefill"
DECODE = "decode"
LOAD = "load"          # model load
TOKENIZE = "tokenize"
PHASES = (PREFILL, DECODE, LOAD, TOKENIZE)

# How often a live view gets a decode step's per-layer timeline: TraceRecorder(detail_hz=). Ten new timelines a
# second are more than a reader follows; each costs the engine its events (see engine/trace/recorder.py).
LIVE_DETAIL_HZ = 10.0
# ... where the window draws little and the engine's host work is what sets its pace: in the offload modes on a GPU
# (about 1.5 draws a second, app/telemetry.py's gui_budget; their decode is a Python loop on one host core, and
# reading a timed layerwise step's ~330 events took ~2.6 ms of it: H100, the default model, ~3% of the turn at ten
# a second); on a CPU every decode step of the default model, ~0.15 s, was timed at ten a second, and watching
# cost its layerwise decode 1.10-1.13x.
LOW_DETAIL_HZ = 3.0
# ... and on a CPU, whose window draws once every 1-2 s while the engine's threads take every core: a timeline a
# second (at 3 a second every other decode step of the default model, ~0.25 s, was timed, and each one's bars were
# sent, kept and painted by a window whose every busy moment the engine's threads lose on two cores).
CPU_DETAIL_HZ = 1.0


def live_detail_hz(device: str, mode: str) -> float:
    """The live views' timeline rate for an engine on `device` in `mode`."""
    if not str(device).startswith("cuda"):
        return CPU_DETAIL_HZ
    return LOW_DETAIL_HZ if mode in ("layerwise", "chunked") else LIVE_DETAIL_HZ


@dataclass(slots=True)
class Span:
    """One interval of work on one lane. `bytes` is what a copy moved (0 for compute)."""
    lane: str
    name: str
    t0_us: float
    t1_us: float
    layer: int | None = None
    bytes: int = 0
    slot: int | None = None
    args: dict | None = None

    @property
    def dur_us(self) -> float:
        return self.t1_us - self.t0_us


@dataclass(slots=True)
class SlotState:
    """A ring slot changed state at `t_us`: it now holds `tokens` of `layer`'s KV (room for `capacity`)."""
    t_us: float
    slot: int
    layer: int | None
    state: str
    tokens: int
    capacity: int


@dataclass(slots=True)
class QuestPick:
    """The KV pages Quest chose for one (layer, kv head) in a step, with their upper-bound scores.

    `blocks` are global page ids (host block * pages per block + i); `positions` the same pages as indices into
    the sequence's pages (page j holds tokens j * page_size ...), `page_size` tokens each."""
    step: int
    layer: int
    kv_head: int
    blocks: np.ndarray
    scores: np.ndarray
    n_blocks: int           # pages there were to choose from
    positions: np.ndarray | None = None
    page_size: int = 0


class QuestPicks(Sequence):
    """A step's Quest picks, one QuestPick per (layer, kv head), made on first use from the arrays the engine
    recorded per step ([layers, Hkv, k] pages, scores, positions). A step of Qwen3-4B's shape has 272 picks:
    kept as three arrays, recording, copying and pickling it (the app's engine process sends every step) moves
    those arrays, not hundreds of objects (~0.1 ms instead of ~3 ms to pickle)."""
    __slots__ = ("_single", "_bulk", "_items")

    def __init__(self, single: list[QuestPick] = (), bulk: list[tuple] = ()):
        self._single = list(single)       # picks recorded one at a time
        self._bulk = list(bulk)           # (step, layers, pages, scores, n_pages, positions, page_size), numpy
        self._items: list[QuestPick] | None = None

    def __len__(self) -> int:
        return len(self._single) + sum(len(b[1]) * b[2].shape[1] for b in self._bulk)

    def _expand(self) -> list[QuestPick]:
        if self._items is None:
            items = list(self._single)
            for step, layers, pages, scores, n_pages, positions, page_size in self._bulk:
                items += [QuestPick(step, layer, h, pages[i, h], scores[i, h], n, positions[i, h], page_size)
                          for i, (layer, n) in enumerate(zip(layers, n_pages)) for h in range(pages.shape[1])]
            self._items = items
        return self._items

    def __getitem__(self, i):
        return self._expand()[i]

    def __iter__(self):
        return iter(self._expand())

    @property
    def parts(self) -> tuple[list[QuestPick], list[tuple]]:
        """What it was made from: the single picks and the bulk records (step, layers, pages, scores, n_pages,
        positions, page_size), as pickling and recordings (engine/trace/recording.py) keep them."""
        return self._single, self._bulk

    def __reduce__(self):
        return QuestPicks, self.parts

    def __repr__(self) -> str:
        return f"QuestPicks({len(self)} picks)"


@dataclass(slots=True)
class MaskSummary:
    """A sparse prefill mask of one (layer, head): kept vertical columns and slash diagonals over n tokens.

    `image` is an optional small binned picture of the mask (uint8 or float), ready to draw.
    """
    layer: int
    head: int
    vertical: np.ndarray
    slash: np.ndarray
    n: int
    density: float
    image: np.ndarray | None = None


@dataclass(slots=True)
class StepTrace:
    """Everything recorded in one step (a prefill chunk, a decode step, a model load or a tokenization).

    `t0_us`/`t1_us` bound every span, slot state and the step itself; `spans` are sorted by lane (display
    order) then start time. `metrics` are plain floats (timings, token counts, memory: keys `mem_*`/`gpu_mem*`).
    """
    step: int
    phase: str
    n_tokens: int
    t0_us: float
    t1_us: float
    spans: list[Span] = field(default_factory=list)
    slots: list[SlotState] = field(default_factory=list)
    quest: Sequence[QuestPick] = field(default_factory=list)   # a QuestPicks from the recorder
    masks: list[MaskSummary] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    detailed: bool = True   # False: no per-layer timeline was recorded (spans, slots), see TraceRecorder's detail
    windows: list[tuple[float, float]] | None = None   # a step of parts (chunks) timed in some: where its timeline is

    @property
    def dur_us(self) -> float:
        return self.t1_us - self.t0_us

    @property
    def label(self) -> str:
        """Short name for the step, e.g. "prefill 4096 tok"."""
        return f"{self.phase} {self.n_tokens} tok"

    @property
    def timeline(self) -> list[tuple[float, float]]:
        """The intervals [(t0_us, t1_us)] this step's per-layer timeline covers: all of it, none, or its detailed
        parts (`windows`)."""
        if not self.detailed:
            return []
        return [(self.t0_us, self.t1_us)] if self.windows is None else self.windows

    def lane_spans(self, lane: str) -> list[Span]:
        return [s for s in self.spans if s.lane == lane]
