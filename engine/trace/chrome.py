"""Chrome trace-event JSON (opens in Perfetto and chrome://tracing), plus a validator and a track summary.

Layout: one process (pid 1) named `process_name`; one track (tid) per lane in display order, after a
"steps" track whose `X` events are the steps themselves ("prefill 4096 tok"). Spans are `X` events with
`ts`/`dur` in µs and `args` {layer, slot, bytes, GB/s, ...}. `C` counters: "ring slots" (how many ring
slots are in each state, after every slot-state change) and every step metric named `mem_*` / `gpu_mem*`
(sampled at the step's end). Times are rounded to the ns.

Overflow tracks: on one track, `X` events must nest (a viewer draws a partial overlap wrongly). Where two
spans of one lane partly overlap (two copy threads, say), the later one goes to the first overflow track
where it nests: tid = lane tid + 100·k, named e.g. "h2d #2" for k = 1.
"""
from __future__ import annotations

import gzip as _gzip
import json
import math
import numbers
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from engine.trace import fastjson
from engine.trace.events import LANES, SLOT_STATES, StepTrace

STEPS_TRACK = "steps"
TOLERANCE_US = 0.001
_BASE_TIDS = {STEPS_TRACK: 1, **{lane: i + 2 for i, lane in enumerate(LANES)}}
_PID = 1


def to_chrome_trace(steps: Iterable[StepTrace], process_name: str = "kvscope") -> dict:
    """The steps (any order) as a trace-event dict with `traceEvents` and `displayTimeUnit: "ms"`."""
    steps = sorted(steps, key=lambda s: (s.t0_us, s.step))
    tids = dict(_BASE_TIDS)
    for st in steps:
        for sp in st.spans:
            tids.setdefault(sp.lane, len(tids) + 1)
    # (base track name, ts, dur, name, args) per track, then placed on nesting (overflow) tracks
    items: dict[str, list] = {name: [] for name in tids}
    for st in steps:
        args = {"step": st.step, "phase": st.phase, "n_tokens": st.n_tokens, "device": st.device,
                **{k: jsonable(v) for k, v in st.metrics.items()}}
        items[STEPS_TRACK].append((st.t0_us, st.t1_us, st.label, args))
        for sp in st.spans:
            a = {"step": st.step}
            if sp.layer is not None:
                a["layer"] = sp.layer
            if sp.slot is not None:
                a["slot"] = sp.slot
            if sp.bytes:
                a["bytes"] = int(sp.bytes)
                if sp.dur_us > 0:
                    a["GB/s"] = round(sp.bytes / (sp.dur_us * 1e3), 3)
            if sp.args:
                a.update({str(k): jsonable(v) for k, v in sp.args.items()})
            items[sp.lane].append((sp.t0_us, sp.t1_us, sp.name, a))

    events: list[dict] = [{"ph": "M", "pid": _PID, "tid": 0, "name": "process_name", "args": {"name": process_name}}]
    placed_rows: list[tuple] = []          # (tid, track, t0, t1, name, args) of every X event
    for track, base in tids.items():
        for k, placed in enumerate(_place_nested(items[track])):
            if k > 0 and not placed:
                continue
            tid = base + 100 * k
            label = track if k == 0 else f"{track} #{k + 1}"
            events.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": label}})
            events.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
            placed_rows += [(tid, track, *it) for it in placed]
    if placed_rows:        # times rounded to the ns all at once (a round() per time was a fifth of a recording's write)
        tid, cat, t0, t1, name, args = zip(*placed_rows)
        ts, end = _ns(t0), _ns(t1)                          # round both ends, not the duration: shared ends stay equal
        dur = _ns(np.maximum(end - ts, 0.0))
        order = np.lexsort((-dur, ts)).tolist()             # by start, the longer first
        ts, dur = ts.tolist(), dur.tolist()
        events += [{"ph": "X", "pid": _PID, "tid": tid[i], "name": name[i], "cat": cat[i], "ts": ts[i], "dur": dur[i],
                    "args": args[i]} for i in order]
    events += _counters(steps)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _ns(t) -> np.ndarray:
    """µs times (float64) rounded to the ns."""
    return np.rint(np.asarray(t, dtype=np.float64) * 1000.0) / 1000.0


def _place_nested(items: list) -> list[list]:
    """Greedy: each interval (by start, longer first) goes to the first track where it nests."""
    tracks: list[list] = []
    stacks: list[list[float]] = []   # open interval ends per track
    for it in sorted(items, key=lambda it: (it[0], -it[1])):
        t0, t1 = it[0], max(it[0], it[1])
        for track, stack in zip(tracks, stacks):
            while stack and stack[-1] <= t0 + TOLERANCE_US:
                stack.pop()
            if not stack or t1 <= stack[-1] + TOLERANCE_US:
                break
        else:
            track, stack = [], []
            tracks.append(track)
            stacks.append(stack)
        track.append(it)
        stack.append(t1)
    return tracks or [[]]


def _counters(steps: list[StepTrace]) -> list[dict]:
    out = []
    state: dict[int, str] = {}
    counts = {k: 0 for k in SLOT_STATES}       # slots in each state, kept as states change
    named: dict[str, bool] = {}                # metric name -> is it a counter
    for st in steps:
        for s in st.slots:
            old = state.get(s.slot)
            if old is not None:
                counts[old] -= 1
                if not counts[old] and old not in SLOT_STATES:
                    del counts[old]
            state[s.slot] = s.state
            counts[s.state] = counts.get(s.state, 0) + 1
            out.append({"ph": "C", "pid": _PID, "tid": 0, "name": "ring slots", "ts": round(s.t_us, 3),
                        "args": dict(counts)})
        for k, v in st.metrics.items():
            counter = named.get(k)
            if counter is None:                # (a Quest step has ~60 metrics: each key is looked at once)
                counter = named[k] = k.startswith(("mem_", "gpu_mem"))
            if counter and _is_number(v):
                out.append({"ph": "C", "pid": _PID, "tid": 0, "name": k, "ts": round(st.t1_us, 3),
                            "args": {"value": float(v)}})
    return out


def write_chrome_trace(steps: Iterable[StepTrace] | dict, path: str | os.PathLike, gzip: bool | None = None) -> Path:
    """Write the trace (or an already built trace dict) as JSON; gzip when asked or the path ends with .gz.

    Writes a temporary file beside `path`, then renames it, so a reader never sees half a file.
    """
    path = Path(path)
    obj = steps if isinstance(steps, dict) else to_chrome_trace(steps)
    data = fastjson.dumps(obj)
    if gzip or (gzip is None and path.suffix == ".gz"):
        data = _gzip.compress(data, compresslevel=6)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_chrome_trace(path: str | os.PathLike) -> dict:
    """Read a trace written by `write_chrome_trace` (gzip recognised by its magic bytes)."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = _gzip.decompress(data)
    return json.loads(data)


def check_chrome_trace(obj, max_problems: int = 50) -> list[str]:
    """Problems in a trace-event object (empty list = valid); see the module docstring for the rules."""
    problems: list[str] = []
    events = obj.get("traceEvents") if isinstance(obj, dict) else obj
    if not isinstance(events, list):
        return ["no traceEvents list"]
    named: set[tuple] = set()
    xs: dict[tuple, list[tuple[float, float, str]]] = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict) or "ph" not in e:
            problems.append(f"event {i}: not an object with 'ph'")
            continue
        ph = e["ph"]
        if ph not in ("M", "X", "C"):
            problems.append(f"event {i}: unsupported phase {ph!r}")
            continue
        missing = [k for k in ("pid", "tid", "name") if k not in e]
        if missing:
            problems.append(f"event {i} ({ph}): missing {', '.join(missing)}")
            continue
        key = (e["pid"], e["tid"])
        if ph == "M":
            if e["name"] == "thread_name":
                named.add(key)
        elif ph == "X":
            ts, dur = e.get("ts"), e.get("dur")
            if not (_is_number(ts) and _is_number(dur)):
                problems.append(f"event {i} ({e['name']!r}): X needs numeric ts and dur")
            elif dur < 0:
                problems.append(f"event {i} ({e['name']!r}): negative dur {dur}")
            else:
                xs.setdefault(key, []).append((ts, ts + dur, e["name"]))
        else:
            args = e.get("args")
            if not _is_number(e.get("ts")):
                problems.append(f"event {i} ({e['name']!r}): C needs a numeric ts")
            if not isinstance(args, dict) or not args or not all(_is_number(v) for v in args.values()):
                problems.append(f"event {i} ({e['name']!r}): C needs args with numeric values")
    for key, spans in xs.items():
        if key not in named:
            problems.append(f"pid {key[0]} tid {key[1]}: X events but no thread_name")
        stack: list[tuple[float, str]] = []
        for t0, t1, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][0] <= t0 + TOLERANCE_US:
                stack.pop()
            if stack and t1 > stack[-1][0] + TOLERANCE_US:
                problems.append(f"pid {key[0]} tid {key[1]}: {name!r} [{t0}, {t1}] partly overlaps "
                                f"{stack[-1][1]!r} (ends {stack[-1][0]})")
            stack.append((t1, name))
    if len(problems) > max_problems:
        problems = problems[:max_problems] + [f"... and {len(problems) - max_problems} more"]
    return problems


def summarize_chrome_trace(obj) -> dict:
    """{"tracks": {track name: X event count}, "counters": {name: C event count}, "t0_us", "t1_us"}."""
    events = obj.get("traceEvents", []) if isinstance(obj, dict) else obj
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name")
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tracks = {n: 0 for n in names.values()}
    counters: dict[str, int] = {}
    t0, t1 = math.inf, -math.inf
    for e in events:
        if e.get("ph") == "X":
            n = names.get((e.get("pid"), e.get("tid")), f"tid {e.get('tid')}")
            tracks[n] = tracks.get(n, 0) + 1
            t0, t1 = min(t0, e["ts"]), max(t1, e["ts"] + e["dur"])
        elif e.get("ph") == "C":
            counters[e["name"]] = counters.get(e["name"], 0) + 1
    return {"tracks": tracks, "counters": counters,
            "t0_us": t0 if t0 <= t1 else 0.0, "t1_us": t1 if t0 <= t1 else 0.0}


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


_PLAIN = frozenset((str, bool, int, type(None)))


def jsonable(v):
    """Numpy scalars/arrays and other odd values as plain JSON values (NaN / inf become null)."""
    t = type(v)                       # (the plain types first: a step's metrics are most of a trace's values)
    if t is float:
        return v if math.isfinite(v) else None
    if t in _PLAIN:
        return v
    if t is dict:
        return {str(k): jsonable(x) for k, x in v.items()}
    if v is None or isinstance(v, (str, bool)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v) if math.isfinite(v) else None
    if hasattr(v, "tolist"):
        return jsonable(v.tolist())
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return str(v)
