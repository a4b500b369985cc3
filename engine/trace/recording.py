"""Recordings: one `.kvscope` file with everything the views draw for a conversation, to open without a model.

    rec = Recording(meta={...}, document="text", turns=[{...}], steps=[StepTrace, ...])
    save_recording(rec, "run.kvscope")            # written beside, then renamed: never half a file
    rec = load_recording("run.kvscope")           # RecordingError (one line) for anything that is not one

The format (version 3) is a zip archive, open to any tool:

- `manifest.json`: {"format": "kvscope-recording", "version": 3, "created" (UTC, ISO 8601), "host", "platform",
  "app": {model, engine, document (name, path, tokens, encoding), sampling, system_prompt, panel},
  "turns": [{question, answer, stats, engine, first_step, last_step, token_map (its array's reference or null),
  token_map_reason}], "n_steps", "narrowed": {array name: its dtype}}. `app` and each turn's `stats`/`engine` are
  what the app and the engine reported (free-form JSON, for the views).
- `document.txt`: the document's text (UTF-8); Quest's pages map into it through a turn's token map.
- `steps.json`: one object per engine step: step, phase, n_tokens, t0_us, t1_us, device, detailed, windows,
  metrics, `spans` as rows [lane, name, t0_us, t1_us, layer, bytes, slot, args], `slots` as rows [t_us, slot,
  layer, state, tokens, capacity], `quest` (per bulk record: step, layers, n_pages, page_size and the references of its
  pages / scores / positions arrays; single picks likewise), `masks` (per head: layer, head, n, density and the
  references of its vertical / slash / image arrays). Times are µs on the recording engine's clock.
- `arrays.npz`: the arrays steps.json and the turns refer to (numpy's npz, stored uncompressed). Arrays of one kind,
  shape and dtype are stacked into one (`pages3` [steps, ...]); a reference "pages3#5" is its row 5. Quest pages
  int32 [layers, Hkv, k], scores float32, positions int32 (a pick whose positions equal its pages refers to the
  pages for both); masks' vertical and slash indices, mask images; token maps int32 [tokens, 2]. An integer array
  whose values fit int16 is stored as int16 and listed in `narrowed` with its dtype, which a reader restores.
  (Version 2 kept an array per reference, named by it; version 1 also had no `narrowed`, and zip-compressed the
  npz: writing a 128K-token Quest turn's picks took seconds.)
- `trace.json`: the same steps as Chrome trace events: opens in Perfetto (ui.perfetto.dev) as it is.

A reader refuses a newer version with a message that says so; fields it does not know are ignored, so a version
adds fields without a new number unless an older reader would misread the file (version 2's int16 arrays, version
3's references).
Nothing here imports torch or Qt.
"""
from __future__ import annotations

import io
import json
import os
import platform
import socket
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.trace import fastjson
from engine.trace.chrome import jsonable, to_chrome_trace
from engine.trace.events import LANES, MaskSummary, QuestPick, QuestPicks, SlotState, Span, StepTrace

FORMAT = "kvscope-recording"
VERSION = 3   # 3: arrays stacked by kind, referred to by row; 2: integer arrays narrowed to int16 where they
              # fit (`narrowed`); 1 and 2 are read too
SUFFIX = ".kvscope"


class RecordingError(ValueError):
    """A file that cannot be read as a recording, in one line naming the file, the problem and the fix."""


@dataclass
class Recording:
    """What a recording holds. `turns`: dicts with question, answer, stats, engine, first_step, last_step and
    optionally token_map (int32 [n, 2] numpy: each prompt token's document characters, app/quest_highlight.py) and
    token_map_reason. `meta`: the manifest's other fields (app, created, host, platform; `source` is the file it
    was read from)."""
    meta: dict = field(default_factory=dict)
    document: str = ""
    turns: list[dict] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)

    def turn_steps(self, i: int) -> list[StepTrace]:
        """The steps of turn i (those numbered first_step..last_step)."""
        t = self.turns[i]
        return [s for s in self.steps if t["first_step"] <= s.step <= t["last_step"]]

    @property
    def label(self) -> str:
        """A short name: the model, policy and mode of the last turn, where and when it was made."""
        app, turn = self.meta.get("app") or {}, (self.turns[-1] if self.turns else {})
        engine = turn.get("engine") or app.get("engine") or {}
        model = (app.get("model") or {}).get("name") or engine.get("model") or "model"
        return (f"{model} · {engine.get('policy', 'full')} · {engine.get('mode', 'gpu')} · "
                f"{self.meta.get('device') or (app.get('model') or {}).get('device', '?')} · "
                f"{self.meta.get('host', '?')} {str(self.meta.get('created', ''))[:16].replace('T', ' ')}")


# ---------------------------------------------------------------------------------------------------- writing
class _Arrays:
    """The arrays for arrays.npz, stacked: those of one kind, shape and dtype (a Quest pick's pages at every decode
    step, say) are one array in the file, and a step names its row, "name#row". An npz pays a zip member for every
    array (a 64-token Quest turn had 128 of them: ~5 ms of its write on this project's CPU, 1 ms stacked). Integer
    arrays whose values fit int16 are stored as int16 (`narrowed`: their names and dtypes, restored on reading)."""

    def __init__(self):
        self.names: dict[tuple, str] = {}           # (kind, shape, dtype) -> the stacked array's name
        self.rows: dict[str, list[np.ndarray]] = {}

    def put(self, kind: str, a, same_as: str | None = None) -> str | None:
        """Keep `a` as a row of its kind's array -> its reference; where it equals the array `same_as` refers to,
        keep nothing and return that reference (a Quest pick's positions are its pages when the pool holds one
        sequence in order)."""
        if a is None:
            return None
        a = np.asarray(a)
        if same_as is not None:
            b = self[same_as]
            if a.dtype == b.dtype and np.array_equal(a, b):
                return same_as
        key = (kind, a.shape, a.dtype.str)
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = f"{kind}{len(self.rows)}"
            self.rows[name] = []
        self.rows[name].append(a)
        return f"{name}#{len(self.rows[name]) - 1}"

    def __getitem__(self, ref: str) -> np.ndarray:
        name, row = ref.rsplit("#", 1)
        return self.rows[name][int(row)]

    def stacked(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """-> the arrays by name, and `narrowed` (name -> dtype of the arrays stored as int16)."""
        data, narrowed = {}, {}
        for name, rows in self.rows.items():
            a = np.stack(rows)
            if a.dtype.kind in "iu" and a.dtype.itemsize > 2 and a.size and a.min() >= -2**15 and a.max() < 2**15:
                narrowed[name] = a.dtype.str
                a = a.astype(np.int16)
            data[name] = a
        return data, narrowed


def _step_json(s: StepTrace, arrays: _Arrays) -> dict:
    lanes = {lane: i for i, lane in enumerate(LANES)}
    quest = []
    picks = s.quest if isinstance(s.quest, QuestPicks) else QuestPicks(list(s.quest))
    single, bulk = picks.parts
    for step, layers, pages, scores, n_pages, positions, page_size in bulk:
        at = arrays.put("pages", pages)
        quest.append({"step": int(step), "layers": [int(x) for x in layers], "n_pages": [int(x) for x in n_pages],
                      "page_size": int(page_size), "pages": at, "scores": arrays.put("scores", scores),
                      "positions": arrays.put("positions", positions, same_as=at)})
    for q in single:
        at = arrays.put("pick_pages", q.blocks)
        quest.append({"single": True, "step": int(q.step), "layer": int(q.layer), "kv_head": int(q.kv_head),
                      "n_pages": int(q.n_blocks), "page_size": int(q.page_size), "pages": at,
                      "scores": arrays.put("pick_scores", q.scores),
                      "positions": arrays.put("pick_positions", q.positions, same_as=at)})
    masks = [{"layer": int(m.layer), "head": int(m.head), "n": int(m.n), "density": float(m.density),
              "vertical": arrays.put("vertical", m.vertical), "slash": arrays.put("slash", m.slash),
              "image": arrays.put("mask", m.image)} for m in s.masks]
    return {"step": s.step, "phase": s.phase, "n_tokens": s.n_tokens, "t0_us": s.t0_us, "t1_us": s.t1_us,
            "device": s.device, "detailed": s.detailed, "windows": s.windows, "metrics": s.metrics,
            "spans": [[lanes.get(x.lane, x.lane), x.name, x.t0_us, x.t1_us, x.layer, x.bytes, x.slot, x.args]
                      for x in s.spans],
            "slots": [[x.t_us, x.slot, x.layer, x.state, x.tokens, x.capacity] for x in s.slots],
            "quest": quest, "masks": masks}


def _default(v):
    return v.tolist() if isinstance(v, np.ndarray) else v.item() if isinstance(v, np.generic) else str(v)


def _dumps(v) -> bytes:
    """Compact JSON of `v` as chrome.jsonable makes it (a float that is not finite: null, as orjson writes it);
    numpy values are met by the encoder's `default`, so only a dict with keys JSON cannot take (numpy integers, say)
    costs the walk over everything."""
    try:
        return fastjson.dumps(v, default=_default)
    except TypeError:
        return fastjson.dumps(jsonable(v))


def _platform() -> str:
    """The system, as platform.platform() says it without its C library's version: finding that reads the Python
    executable (~9 ms on this project's CPU, once a process: most of a short turn's `chat --record` write)."""
    return f"{platform.system()}-{platform.release()}-{platform.machine()}"


def save_recording(rec: Recording, path: str | os.PathLike) -> Path:
    """Write `rec` to `path` (a temporary file beside it, then renamed). Returns the path."""
    path = Path(path)
    arrays = _Arrays()
    turns = []
    for t in rec.turns:
        turn = {k: v for k, v in t.items() if k != "token_map"}
        turn["token_map"] = arrays.put("token_map", t.get("token_map"))
        turns.append(jsonable(turn))
    steps = [_step_json(s, arrays) for s in rec.steps]
    arrays_by_name, narrowed = arrays.stacked()
    meta = {k: v for k, v in rec.meta.items() if k not in ("format", "version", "turns", "n_steps", "source")}
    manifest = {"format": FORMAT, "version": VERSION,
                "created": meta.pop("created", None) or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "host": meta.pop("host", None) or socket.gethostname(),
                "platform": meta.pop("platform", None) or _platform(), **jsonable(meta),
                "turns": turns, "n_steps": len(steps), "narrowed": narrowed}
    npz = io.BytesIO()
    np.savez(npz, **arrays_by_name)       # stored as it is: compressing it took most of a 128K turn's write
    data = io.BytesIO()                   # made in memory, then one write (a zip on a file writes ~40 times)
    with zipfile.ZipFile(data, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:   # (level 6: 2-3x the time)
        z.writestr("manifest.json", json.dumps(manifest, indent=1))
        z.writestr("document.txt", rec.document)
        z.writestr("steps.json", _dumps(steps))
        z.writestr("trace.json", fastjson.dumps(to_chrome_trace(rec.steps)))
        z.writestr("arrays.npz", npz.getbuffer(), zipfile.ZIP_STORED)   # (last: see load_recording)
    fd, tmp = tempfile.mkstemp(dir=path.absolute().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.getbuffer())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------------- reading
def _step(d: dict, get) -> StepTrace:
    """A step from its steps.json object; get(reference) -> the array it names (None for None)."""
    lanes = dict(enumerate(LANES))
    single, bulk = [], []
    for q in d.get("quest", []):
        if q.get("single"):
            single.append(QuestPick(q["step"], q["layer"], q["kv_head"], get(q["pages"]), get(q["scores"]),
                                    q["n_pages"], get(q["positions"]), q["page_size"]))
        else:
            bulk.append((q["step"], q["layers"], get(q["pages"]), get(q["scores"]), q["n_pages"],
                         get(q["positions"]), q["page_size"]))
    masks = [MaskSummary(m["layer"], m["head"], get(m["vertical"]), get(m["slash"]), m["n"], m["density"],
                         get(m["image"])) for m in d.get("masks", [])]
    spans = [Span(lanes.get(r[0], r[0]) if isinstance(r[0], int) else r[0], *r[1:]) for r in d.get("spans", [])]
    slots = [SlotState(*r) for r in d.get("slots", [])]
    windows = [tuple(w) for w in d["windows"]] if d.get("windows") is not None else None
    return StepTrace(d["step"], d["phase"], d["n_tokens"], d["t0_us"], d["t1_us"], spans, slots,
                     QuestPicks(single, bulk), masks, d.get("metrics") or {}, d.get("device", "cpu"),
                     d.get("detailed", True), windows)


def load_recording(path: str | os.PathLike) -> Recording:
    """Read a recording; RecordingError (one line: the file, what is wrong, what to do) for a file that is missing,
    not a recording, truncated or corrupt, or from a newer format version."""
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such file; give the path of a .kvscope recording")
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            if all(n.endswith(".npy") for n in names):   # a file cut inside its end: the stored npz's
                raise zipfile.BadZipFile("the file ends early")     # own directory is what a zip reader finds
            if "manifest.json" not in names:
                raise RecordingError(f"{path}: not a kvscope recording (no manifest.json in it); record one with "
                                     "`python main.py chat --record FILE` or File → Save recording")
            manifest = json.loads(z.read("manifest.json"))
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise RecordingError(f"{path}: not a kvscope recording (its manifest is not one)")
            version = manifest.get("version")
            if not isinstance(version, int) or version > VERSION:
                raise RecordingError(f"{path}: made by a newer kvscope (recording format version {version}; this one "
                                     f"reads up to {VERSION}): update kvscope to open it")
            document = z.read("document.txt").decode("utf-8")
            steps_json = json.loads(z.read("steps.json"))
            with np.load(io.BytesIO(z.read("arrays.npz")), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            for k, dtype in (manifest.get("narrowed") or {}).items():     # (versions 2 and 3)
                arrays[k] = arrays[k].astype(dtype)
    except RecordingError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise RecordingError(f"{path}: not a kvscope recording, or a truncated or corrupt one ({e}); record it "
                             "again") from None
    except (KeyError, ValueError, OSError, UnicodeDecodeError) as e:
        raise RecordingError(f"{path}: a damaged kvscope recording ({type(e).__name__}: {e}); record it "
                             "again") from None
    def get(ref):       # version 3: "name#row" of a stacked array; before: an array's name
        if ref is None:
            return None
        if version < 3:
            return arrays[ref]
        name, row = ref.rsplit("#", 1)
        return arrays[name][int(row)]

    try:
        steps = [_step(d, get) for d in steps_json]
        turns = []
        for t in manifest.get("turns", []):
            turn = dict(t)
            turn["token_map"] = get(t.get("token_map") or None)
            turns.append(turn)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise RecordingError(f"{path}: a damaged kvscope recording (its steps do not read: {type(e).__name__}: "
                             f"{e}); record it again") from None
    meta = {k: v for k, v in manifest.items() if k not in ("turns",)}
    meta["source"] = str(path)
    return Recording(meta, document, turns, steps)


def is_recording(path: str | os.PathLike) -> bool:
    """Does `path` look like a recording (by its suffix)? For the command line's `python main.py FILE`."""
    return str(path).endswith(SUFFIX)
