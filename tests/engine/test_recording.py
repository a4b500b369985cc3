"""Recordings (engine/trace/recording.py): a real engine's steps round-trip, and bad files are refused in one line."""
import io
import json
import zipfile

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.trace import TraceRecorder, check_chrome_trace
from engine.trace.recording import Recording, RecordingError, load_recording, save_recording

QUEST = {"token_budget": 256, "page_size": 16, "dense_layers": 2, "min_context": 0, "min_layer_mb": 0}
MINF = {"vertical": 16, "slash": 32, "min_len": 64, "block": 16, "sink": 4, "recent": 16, "cpu_dense_above": 1.0}


def record(model_dir, policy, params, prompt, tokens=3) -> Recording:
    rec = TraceRecorder()
    with LLM(str(model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048, policy=policy,
             policy_params=params, recorder=rec) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
    steps = list(rec.steps)
    token_map = np.stack([np.arange(len(prompt)), np.arange(len(prompt)) + 1], 1).astype(np.int32)
    turn = {"question": "q?", "answer": out.text, "stats": out.stats.to_dict(), "engine": {"policy": policy},
            "first_step": steps[0].step, "last_step": steps[-1].step, "token_map": token_map}
    return Recording({"app": {"model": {"name": "SmolLM2"}}}, "x" * len(prompt), [turn], steps)


def same_steps(a, b) -> None:
    assert [(s.step, s.phase, s.n_tokens, s.t0_us, s.t1_us, s.detailed, s.metrics) for s in a] == \
           [(s.step, s.phase, s.n_tokens, s.t0_us, s.t1_us, s.detailed, s.metrics) for s in b]
    for x, y in zip(a, b):
        assert x.spans == y.spans and x.slots == y.slots
        assert [(p.layer, p.kv_head, p.n_blocks, p.page_size, p.blocks.tolist(), p.scores.tolist(),
                 p.positions.tolist()) for p in x.quest] == \
               [(p.layer, p.kv_head, p.n_blocks, p.page_size, p.blocks.tolist(), p.scores.tolist(),
                 p.positions.tolist()) for p in y.quest]
        assert [(m.layer, m.head, m.n, m.density, m.vertical.tolist(), m.slash.tolist()) for m in x.masks] == \
               [(m.layer, m.head, m.n, m.density, m.vertical.tolist(), m.slash.tolist()) for m in y.masks]


def test_a_quest_turn_round_trips_with_its_picks_spans_and_token_map(default_model_dir, tmp_path):
    rec = record(default_model_dir, "quest", QUEST, list(range(2000, 2900)))
    assert sum(len(s.quest) for s in rec.steps) > 0 and sum(len(s.spans) for s in rec.steps) > 0
    back = load_recording(save_recording(rec, tmp_path / "q.kvscope"))
    same_steps(rec.steps, back.steps)
    assert back.document == rec.document and back.turns[0]["answer"] == rec.turns[0]["answer"]
    assert back.turns[0]["stats"] == json.loads(json.dumps(rec.turns[0]["stats"]))
    np.testing.assert_array_equal(back.turns[0]["token_map"], rec.turns[0]["token_map"])
    assert back.turn_steps(0) == back.steps and back.meta["version"] == 3 and back.meta["host"]
    assert {p.blocks.dtype for s in back.steps for p in s.quest} == {p.blocks.dtype for s in rec.steps for p in s.quest}
    with zipfile.ZipFile(tmp_path / "q.kvscope") as z:              # the trace inside opens in Perfetto as it is
        assert check_chrome_trace(json.loads(z.read("trace.json"))) == []
        names = np.load(io.BytesIO(z.read("arrays.npz"))).files
    decode_picks = sum(len(s.quest.parts[1]) for s in rec.steps if s.phase == "decode")
    assert decode_picks >= 2 and len([n for n in names if n.startswith("pages")]) == 1, \
        "every decode step's picks have one shape: one stacked array"
    assert not [n for n in names if n.startswith("positions")], \
        "one sequence in the pool: a pick's positions are its pages, stored once"
    assert back.meta["narrowed"] and set(back.meta["narrowed"]) <= set(names)


@pytest.mark.parametrize("version", [1, 2])
def test_a_recording_of_an_older_version_still_opens(default_model_dir, tmp_path, version):
    """Version 2 kept an array per reference (named by it); version 1 also kept int32 arrays, each pick's positions
    apart, in a compressed npz, with no `narrowed`."""
    rec = record(default_model_dir, "quest", QUEST, list(range(2000, 2900)))
    new = save_recording(rec, tmp_path / "v3.kvscope")
    old = tmp_path / f"v{version}.kvscope"
    with zipfile.ZipFile(new) as z, zipfile.ZipFile(old, "w", zipfile.ZIP_DEFLATED) as out:
        manifest = json.loads(z.read("manifest.json"))
        steps = json.loads(z.read("steps.json"))
        stacked = dict(np.load(io.BytesIO(z.read("arrays.npz"))))
        stacked = {k: a.astype(manifest["narrowed"].get(k, a.dtype)) for k, a in stacked.items()}
        arrays = {}

        def unstack(ref):
            if ref is None:
                return None
            name, row = ref.split("#")
            arrays[f"{name}_{row}"] = stacked[name][int(row)]
            return f"{name}_{row}"
        for d in steps:
            for q in d["quest"]:
                q["pages"], q["scores"] = unstack(q["pages"]), unstack(q["scores"])
                q["positions"] = q["pages"]
                if version == 1:
                    q["positions"] = q["pages"].replace("pages", "positions")
                    arrays[q["positions"]] = arrays[q["pages"]].copy()
        for t in manifest["turns"]:
            t["token_map"] = unstack(t["token_map"])
        npz = io.BytesIO()
        np.savez(npz, **arrays)
        del manifest["narrowed"]
        out.writestr("manifest.json", json.dumps({**manifest, "version": version}))
        out.writestr("steps.json", json.dumps(steps))
        out.writestr("arrays.npz", npz.getvalue())
        for name in ("document.txt", "trace.json"):
            out.writestr(name, z.read(name))
    back = load_recording(old)
    assert back.meta["version"] == version
    same_steps(rec.steps, back.steps)
    np.testing.assert_array_equal(back.turns[0]["token_map"], rec.turns[0]["token_map"])


def test_a_minference_prefill_round_trips_with_its_masks(default_model_dir, tmp_path):
    rec = record(default_model_dir, "minference", MINF, list(range(3000, 3300)), tokens=2)
    assert sum(len(s.masks) for s in rec.steps) > 0
    back = load_recording(save_recording(rec, tmp_path / "m.kvscope"))
    same_steps(rec.steps, back.steps)


def test_files_that_are_not_recordings_are_refused_in_one_line(tmp_path):
    text = tmp_path / "notes.kvscope"
    text.write_text("hello")
    with pytest.raises(RecordingError, match="not a kvscope recording"):
        load_recording(text)
    other = tmp_path / "other.kvscope"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("a.txt", "b")
    with pytest.raises(RecordingError, match="no manifest"):
        load_recording(other)
    with pytest.raises(RecordingError, match="no such file"):
        load_recording(tmp_path / "missing.kvscope")


def test_truncated_corrupt_and_newer_recordings_are_refused(tmp_path):
    good = save_recording(Recording({}, "doc", [], []), tmp_path / "good.kvscope")
    assert load_recording(good).document == "doc"
    data = good.read_bytes()
    cut = tmp_path / "cut.kvscope"
    for end in (len(data) // 2, len(data) - 30):    # (the arrays are last, stored: their npz's end is in the file)
        cut.write_bytes(data[:end])
        with pytest.raises(RecordingError, match="truncated or corrupt"):
            load_recording(cut)
    newer = tmp_path / "newer.kvscope"
    with zipfile.ZipFile(good) as z, zipfile.ZipFile(newer, "w") as out:
        for name in z.namelist():
            body = z.read(name)
            if name == "manifest.json":
                body = json.dumps({**json.loads(body), "version": 99}).encode()
            out.writestr(name, body)
    with pytest.raises(RecordingError, match="newer kvscope .*version 99"):
        load_recording(newer)
    broken = tmp_path / "broken.kvscope"
    with zipfile.ZipFile(good) as z, zipfile.ZipFile(broken, "w") as out:
        for name in z.namelist():
            out.writestr(name, b'[{"step": 1}]' if name == "steps.json" else z.read(name))
    with pytest.raises(RecordingError, match="damaged"):
        load_recording(broken)


@pytest.mark.parametrize("encoder", ["orjson", "json"])
def test_both_json_encoders_write_the_recordings_values(encoder, monkeypatch):
    """The fast encoder (orjson, where installed) and the standard library's write the same values: numpy values,
    keys that are not strings, text that is not ASCII, and an integer too wide for orjson (the standard one takes
    it)."""
    from engine.trace import fastjson
    from engine.trace.recording import _default
    if encoder == "json":
        monkeypatch.setattr(fastjson, "orjson", None)
    elif fastjson.orjson is None:
        pytest.skip("orjson is not installed")
    obj = {"t": [1, 2.5, 3053437.269, "é", None, True], "m": {"a": np.float32(0.25), "b": np.int64(7),
                                                              "c": np.arange(3)}, 3: "three"}
    assert json.loads(fastjson.dumps(obj, default=_default)) == {
        "t": [1, 2.5, 3053437.269, "é", None, True], "m": {"a": 0.25, "b": 7, "c": [0, 1, 2]}, "3": "three"}
    assert json.loads(fastjson.dumps({"wide": 2**70})) == {"wide": 2**70}
