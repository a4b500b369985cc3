"""`python main.py chat ...`: answers, stats, and one clear message (no traceback) for each bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "resources" / "samples" / "kv_cache_offload_primer.md"


def run_cli(capsys, *argv):
    code = main(["chat", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_chat_json_end_to_end_in_a_fresh_process(default_model_dir, tmp_path):
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen.\n")
    proc = subprocess.run([sys.executable, "main.py", "chat", "--document", str(doc), "--ask",
                           "In which city is the meeting?", "--max-new-tokens", "24", "--json", "--model",
                           str(default_model_dir)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "Bergen" in result["answer"]
    for key in ("prompt_tokens", "cached_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "finish_reason"):
        assert key in result
    assert result["prompt_tokens"] > 20 and result["device"] == "cpu"


def test_a_second_run_reads_the_document_from_the_disk_tier(capsys, default_model_dir, tmp_path):
    """Two processes, one after the other: the second finds the document's KV pages on disk, computes only the rest
    of its prompt, and answers the same (greedy). Then `kv-store show` and `kv-store clear`. (The sample's first
    third, ~1.6K tokens, six pages: the whole sample's prefill took a CPU ~25 s per process.)"""
    store, doc = tmp_path / "kv", tmp_path / "primer.md"
    doc.write_text(SAMPLE.read_text()[:7000])

    def chat():
        proc = subprocess.run([sys.executable, "main.py", "chat", "--document", str(doc), "--ask", "Where is the lab?",
                               "--max-new-tokens", "8", "--json", "--model", str(default_model_dir), "--kv-store",
                               str(store), "--max-model-len", "8192"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    first, second = chat(), chat()
    assert first["disk_cached_tokens"] == 0 and first["prompt_tokens"] > 1500
    assert second["disk_cached_tokens"] == second["cached_tokens"] >= first["prompt_tokens"] - 256
    assert second["answer"] == first["answer"] and second["ttft_s"] < first["ttft_s"]
    assert main(["kv-store", "show", "--dir", str(store)]) == 0
    out = capsys.readouterr().out
    pages = (first["prompt_tokens"] + first["completion_tokens"] - 1) // 256     # full blocks with KV
    assert f"{pages} pages" in out and "model/format" in out
    assert main(["kv-store", "clear", "--dir", str(store)]) == 0
    assert "deleted" in capsys.readouterr().out and not list(store.glob("*/*/*.kvp"))


def test_streams_the_answer_and_prints_stats(capsys, default_model_dir, tmp_path):
    doc = tmp_path / "primer.md"                     # the sample's first sections, ~1K tokens (the whole: ~25 s here)
    doc.write_text(SAMPLE.read_text()[:4000])
    code, out, err = run_cli(capsys, "--document", str(doc), "--ask", "In which city is the Halvorsen lab based?",
                             "--max-new-tokens", "24", "--model", str(default_model_dir))
    assert code == 0
    assert "Bergen" in out
    assert "prefill" in err and "tok/s" in err and "TTFT" in err


@pytest.mark.parametrize("content, phrase", [(b"", "empty"), (b"\x00\x01\x02binary\xff\xfe" * 10, "binary")])
def test_bad_documents(capsys, tmp_path, content, phrase):
    doc = tmp_path / "bad.txt"
    doc.write_bytes(content)
    code, _, err = run_cli(capsys, "--document", str(doc), "--ask", "hi")
    assert code == 2 and phrase in err and "bad.txt" in err


def test_document_too_long_for_the_context(capsys, tmp_path, default_model_dir):
    doc = tmp_path / "long.md"
    doc.write_text(SAMPLE.read_text() * 2)
    code, _, err = run_cli(capsys, "--document", str(doc), "--ask", "hi", "--model", str(default_model_dir))
    assert code == 2 and "8192" in err and "tokens" in err


def test_missing_model_folder(capsys):
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", "/nonexistent/model")
    assert code == 2 and "model folder not found" in err and "/nonexistent/model" in err


def test_unsupported_architecture_lists_the_supported_ones(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(tmp_path))
    assert code == 2 and "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err and "Qwen3ForCausalLM" in err


def _copy_model(src: Path, dst: Path, weights: bool = True, tokenizer: bool = True):
    for f in src.iterdir():
        is_weights = f.suffix == ".safetensors"
        is_tok = f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges"))
        if (is_weights and not weights) or (is_tok and not tokenizer):
            continue
        (dst / f.name).symlink_to(f)


def test_missing_weights(capsys, tmp_path, default_model_dir):
    _copy_model(default_model_dir, tmp_path, weights=False)
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(tmp_path))
    assert code == 2 and "no *.safetensors" in err


def test_corrupt_weights(capsys, tmp_path, default_model_dir):
    _copy_model(default_model_dir, tmp_path, weights=False)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\x00" * 64)
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(tmp_path))
    assert code == 2 and "corrupt" in err and "model.safetensors" in err


def test_truncated_weights(capsys, tmp_path, default_model_dir):
    _copy_model(default_model_dir, tmp_path, weights=False)
    src = (default_model_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(src[: len(src) // 3])
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(tmp_path))
    assert code == 2 and "corrupt or truncated" in err


def test_missing_tokenizer(capsys, tmp_path, default_model_dir):
    _copy_model(default_model_dir, tmp_path, tokenizer=False)
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(tmp_path))
    assert code == 2 and "tokenizer" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(capsys, default_model_dir):
    code, _, err = run_cli(capsys, "--ask", "hi", "--device", "cuda", "--model", str(default_model_dir))
    assert code == 2 and "no CUDA" in err and "--device cpu" in err


@pytest.mark.parametrize("flag, value, phrase", [("--temperature", "-1", "temperature"), ("--top-p", "1.5", "top_p"),
                                                  ("--max-new-tokens", "0", "max-new-tokens")])
def test_invalid_sampling_values(capsys, flag, value, phrase):
    code, _, err = run_cli(capsys, "--ask", "hi", flag, value)
    assert code == 2 and phrase in err


def test_layerwise_mode_reports_bytes_moved(capsys, tmp_path, default_model_dir):
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen.\n")
    code, out, err = run_cli(capsys, "--document", str(doc), "--ask", "In which city is the meeting?", "--json",
                             "--max-new-tokens", "24", "--model", str(default_model_dir), "--mode", "layerwise",
                             "--ring-slots", "2", "--block-size", "16")
    assert code == 0, err
    result = json.loads(out)
    assert "Bergen" in result["answer"] and result["mode"] == "layerwise"
    assert result["bytes_h2d"] > 0 and result["bytes_d2h"] > 0 and result["plan"]["ring_slots"] == 2
    assert "layerwise plan: 0 of 30 layers resident" in err


def test_host_pool_too_big_for_ram(capsys, default_model_dir):
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(default_model_dir), "--mode", "layerwise",
                           "--host-kv-gb", "100000")
    assert code == 2 and "GiB of RAM is available" in err and "--host-kv-gb" in err


def test_quest_policy_from_the_command_line(capsys, tmp_path, default_model_dir):
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen.\n" * 3)
    code, out, err = run_cli(capsys, "--document", str(doc), "--ask", "In which city is the meeting?", "--json",
                             "--max-new-tokens", "16", "--model", str(default_model_dir), "--mode", "layerwise",
                             "--block-size", "16", "--policy", "quest", "--quest-budget", "64", "--quest-page", "16",
                             "--quest-recent", "16", "--quest-min-context", "0", "--quest-min-layer-mb", "0")
    assert code == 0, err
    result = json.loads(out)
    assert result["policy"] == "quest" and result["policy_params"]["token_budget"] == 64
    assert result["policy_stats"]["selections"] > 0 and result["policy_stats"]["pages_per_head"] == 2
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(default_model_dir), "--policy", "quest")
    assert code == 2 and "layerwise" in err


@pytest.mark.parametrize("policy,flags", [("minference", ["--minference-vertical", "0.1", "--minference-slash", "0.2",
                                                         "--minference-cpu-dense-above", "1"]),
                                          ("xattention", ["--xattention-threshold", "0.8", "--xattention-stride", "8",
                                                          "--xattention-cpu-dense-above", "1"])])
def test_sparse_prefill_policy_from_the_command_line(capsys, tmp_path, default_model_dir, policy, flags):
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen.\n" * 40)
    code, out, err = run_cli(capsys, "--document", str(doc), "--ask", "In which city is the meeting?", "--json",
                             "--max-new-tokens", "4", "--model", str(default_model_dir), "--policy", policy,
                             "--sparse-min-len", "256", *flags)
    assert code == 0, err
    result = json.loads(out)
    assert result["policy"] == policy and result["policy_params"]["min_len"] == 256
    assert result["policy_stats"]["sparse_layers"] == 30 and 0 < result["policy_stats"]["density"] < 1
    code, out, err = run_cli(capsys, "--document", str(doc), "--ask", "In which city is the meeting?", "--json",
                             "--max-new-tokens", "4", "--model", str(default_model_dir), "--policy", policy,
                             "--sparse-min-len", "256")   # the CPU's default: this short a prompt runs dense
    stats = json.loads(out)["policy_stats"]
    assert code == 0 and stats["sparse"] is False and "dense attention is faster on the CPU" in stats["reason"]


# ---------------------------------------------------------------------- policy flags (from engine.sparse.SPECS)
def _flag(spec, param) -> str:
    return "--" + (param.flag or f"{spec.name}-{param.name.replace('_', '-')}")


def test_every_policy_param_has_a_flag_and_help_lists_it(capsys):
    from app.cli import build_parser
    from engine.sparse import SPECS
    chat = build_parser()._subparsers._group_actions[0].choices["chat"]
    options = {s: a for a in chat._actions for s in a.option_strings}
    assert list(options["--policy"].choices) == list(SPECS)
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())     # argparse wraps lines
    for spec in SPECS.values():
        assert f"{spec.name} ({spec.title}: {spec.phase}" in help_text
        for param in spec.params:
            for flag in (_flag(spec, param), *(f"--{a}" for a in param.aliases)):
                assert flag in options, flag
                assert options[flag].default is None           # the spec holds the default, not argparse
                assert flag in help_text, flag
            if param.type is bool:
                assert options[_flag(spec, param)].nargs == 0   # store_true
            else:
                assert options[_flag(spec, param)].type is param.type
                assert f"default: {param.default}" in options[_flag(spec, param)].help


def test_policy_params_come_from_flags_and_inline_and_only_given_ones():
    from app.cli import build_parser, policy_params
    parse = build_parser().parse_args
    assert policy_params(parse(["chat", "--policy", "quest", "--quest-budget", "512", "--quest-recall"])) == {
        "token_budget": 512, "recall": True}
    assert policy_params(parse(["chat", "--policy", "xattention", "--sparse-min-len", "256"])) == {"min_len": 256}
    assert policy_params(parse(["chat", "--policy", "minference", "--sparse-min-len", "256"])) == {"min_len": 256}
    assert policy_params(parse(["chat", "--policy", "quest:page_size=32", "--quest-token-budget", "1024"])) == {
        "page_size": 32, "token_budget": 1024}
    assert policy_params(parse(["chat"])) == {}


@pytest.mark.parametrize("argv, phrases", [
    (["--policy", "quest", "--quest-token-budget", "5"], ["token_budget", "[32, 4194304]", "got 5"]),
    (["--policy", "quest:token_budget=5", "--mode", "layerwise"], ["token_budget", "[32, 4194304]"]),
    (["--policy", "xattention", "--xattention-threshold", "0"], ["threshold", "(0, 1]"]),
    (["--policy", "quest", "--mode", "layerwise", "--quest-page", "24"], ["page_size", "16, 32, 64, 128"]),
    (["--quest-token-budget", "1024"], ["--quest-token-budget applies to --policy quest"]),
    (["--policy", "quest", "--mode", "layerwise", "--minference-slash", "0.5"],
     ["--minference-slash applies to --policy minference"]),
    (["--policy", "quest", "--mode", "layerwise", "--sparse-min-len", "64"],
     ["--sparse-min-len applies to --policy minference or --policy xattention"]),
    (["--policy", "quest:bogus=1", "--mode", "layerwise"], ["bogus", "token_budget"]),
    (["--policy", "quest"], ["layerwise"]),                                    # the mode it cannot run in
])
def test_bad_policy_flags_fail_in_one_line_before_the_model_loads(capsys, argv, phrases):
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", "/nonexistent/model", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(p in lines[0] for p in phrases), (phrases, err)
    assert "model folder" not in err                                          # nothing was loaded


def test_unknown_policy_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--ask", "hi", "--model", "/nonexistent/model", "--policy", "sparsest"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "sparsest" in err and "quest" in err and "model folder" not in err


@pytest.mark.parametrize("mode", ["layerwise", "chunked"])
def test_offload_modes_exit_cleanly_every_time(default_model_dir, tmp_path, mode):
    """The engine's copy threads are joined at the end (LLM.close): a run never aborts at exit (it used to end
    with 'terminate called without an active exception', exit 134, about one run in three)."""
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen. " * 20)
    cmd = [sys.executable, "main.py", "chat", "--document", str(doc), "--ask", "Where?", "--max-new-tokens", "4",
           "--mode", mode, "--no-kv-store", "--block-size", "64", "--model", str(default_model_dir)]
    for _ in range(2):                   # four runs, two at a time (a run is mostly its start: imports, loading)
        procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}) for _ in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            assert "terminate called" not in err and "Traceback" not in err
            assert f"{mode}: KV moved host->device" in err


def test_record_saves_the_turn_with_its_picks_and_token_map(capsys, default_model_dir, tmp_path):
    from engine.trace.recording import load_recording
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen. " * 20 + "\n")
    code, out, err = run_cli(capsys, "--document", str(doc), "--ask", "In which city is the meeting?",
                             "--max-new-tokens", "6", "--model", str(default_model_dir), "--mode", "layerwise",
                             "--policy", "quest:token_budget=128:min_context=0:min_layer_mb=0", "--no-kv-store",
                             "--record", str(tmp_path / "run.kvscope"))
    assert code == 0 and f"written to {tmp_path / 'run.kvscope'}" in err
    rec = load_recording(tmp_path / "run.kvscope")
    turn, = rec.turns
    assert out.strip() == turn["answer"].strip() and turn["question"] == "In which city is the meeting?"
    decodes = [s for s in rec.steps if s.phase == "decode"]
    assert len(decodes) == turn["stats"]["completion_tokens"] - 1 and all(s.quest for s in decodes)
    assert turn["token_map"].shape == (turn["stats"]["prompt_tokens"], 2) and rec.document.startswith("The meeting")
    assert rec.meta["app"]["engine"]["policy"] == "quest" and rec.meta["origin"] == "command line"
    from transformers import AutoTokenizer                 # the document's tokens as the window counts them
    from app.prompt import document_messages
    tok = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    alone = tok.apply_chat_template(document_messages(rec.document, "", doc.name), add_generation_prompt=True)
    assert rec.meta["app"]["document"]["tokens"] == len(alone["input_ids"] if hasattr(alone, "keys") else alone)


def test_a_recording_that_is_not_one_is_refused_in_one_line(capsys, tmp_path):
    bad = tmp_path / "x.kvscope"
    bad.write_text("hello")
    assert main([str(bad)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {bad}: not a kvscope recording") and len(err.strip().splitlines()) == 1


BAD_OUTPUTS = [("/proc/nope/t.json", "its folder /proc/nope does not exist"),   # no such folder
               ("/proc/self/t.json", "cannot create a file in /proc/self"),    # a folder nobody can write, root too
               ("{tmp}/a-file/t.json", "a-file is a file, not a folder"),
               ("{tmp}", "it is a folder; give a file name, e.g. {tmp}/{example}")]


@pytest.mark.parametrize("flag, example", [("--trace", "trace.json"), ("--record", "run.kvscope")])
@pytest.mark.parametrize("where, why", BAD_OUTPUTS)
def test_an_unwritable_trace_or_recording_path_is_refused_before_any_work(capsys, tmp_path, where, why, flag,
                                                                           example):
    """The answer used to be computed and then lost when the trace could not be written."""
    (tmp_path / "a-file").write_text("not a folder")
    where, why = where.format(tmp=tmp_path), why.format(tmp=tmp_path, example=example)
    code, out, err = run_cli(capsys, flag, where, "--ask", "hi")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1      # nothing loaded, one line
    assert err.startswith(f"error: {flag} {where}: ") and why in err
    assert "choose a path in a folder you can write to" in err or "give a file name" in err


@pytest.mark.parametrize("command, example", [
    (["-m", "app.screenshots", "{out}/shots"], None),                # a folder of PNGs
    (["-m", "bench", "--json", "{out}/bench.json"], "bench.json"),
    (["-m", "bench.needle", "needle", "--json", "{out}/needle.json"], "needle.json")])
def test_every_command_line_output_path_is_checked_before_any_work(tmp_path, command, example):
    """The other tools that write where the user says refuse a bad place at once: one line, exit 2."""
    (tmp_path / "a-file").write_text("not a folder")
    for out, why in [("/proc/self", "cannot create a file in /proc/self"),
                     (str(tmp_path / "a-file"), "a-file is a file, not a folder")]:
        argv = [a.format(out=out) for a in command]
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.count("\n") == 1 and why in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"error: {'--json ' if example else ''}{argv[-1]}: ")


@pytest.mark.parametrize("command", [["-m", "bench", "--lengths", "600"], ["-m", "bench.needle", "needle"]])
def test_the_benches_refuse_a_bad_policy_parameter_in_one_line(command):
    proc = subprocess.run([sys.executable, *command, "--policies" if command[1] == "bench" else "--policy",
                           "full,quest:page_size=8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr == "error: quest page_size must be one of 16, 32, 64, 128 (got 8)\n"


def test_a_kv_store_that_is_a_file_is_one_warning_line_and_the_answer_comes(default_model_dir, tmp_path):
    not_a_folder = tmp_path / "kv"
    not_a_folder.write_text("a file")
    doc = tmp_path / "note.txt"
    doc.write_text("The meeting with the Halvorsen lab is on Tuesday in Bergen.\n")
    proc = subprocess.run([sys.executable, "main.py", "chat", "--document", str(doc), "--ask", "Where?",
                           "--max-new-tokens", "2", "--model", str(default_model_dir), "--kv-store", str(not_a_folder)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "warning" in line.lower()]
    assert len(warned) == 1 and warned[0].startswith("warning: KV page store: cannot use") and str(not_a_folder) in warned[0]
    assert "warnings.warn" not in proc.stderr and ".py:" not in proc.stderr
    assert not_a_folder.read_text() == "a file"                       # nothing lost
