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
    """Two processes, one after the other: the second finds the sample's KV pages on disk, computes only the rest
    of its prompt, and answers the same (greedy). Then `kv-store show` and `kv-store clear`."""
    store = tmp_path / "kv"

    def chat():
        proc = subprocess.run([sys.executable, "main.py", "chat", "--max-new-tokens", "8", "--json", "--model",
                               str(default_model_dir), "--kv-store", str(store), "--max-model-len", "8192"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    first, second = chat(), chat()
    assert first["disk_cached_tokens"] == 0 and first["prompt_tokens"] > 5000
    assert second["disk_cached_tokens"] == second["cached_tokens"] >= first["prompt_tokens"] - 256
    assert second["answer"] == first["answer"] and second["ttft_s"] < first["ttft_s"]
    assert main(["kv-store", "show", "--dir", str(store)]) == 0
    out = capsys.readouterr().out
    pages = (first["prompt_tokens"] + first["completion_tokens"] - 1) // 256     # full blocks with KV
    assert f"{pages} pages" in out and "model/format" in out
    assert main(["kv-store", "clear", "--dir", str(store)]) == 0
    assert "deleted" in capsys.readouterr().out and not list(store.glob("*/*/*.kvp"))


def test_streams_the_answer_and_prints_stats(capsys, default_model_dir):
    code, out, err = run_cli(capsys, "--document", str(SAMPLE), "--ask", "In which city is the Halvorsen lab based?",
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
                             "--block-size", "16", "--policy", "quest", "--quest-budget", "32", "--quest-page", "16")
    assert code == 0, err
    result = json.loads(out)
    assert result["policy"] == "quest" and result["policy_params"]["token_budget"] == 32
    assert result["policy_stats"]["selections"] > 0 and result["policy_stats"]["pages_per_head"] == 2
    code, _, err = run_cli(capsys, "--ask", "hi", "--model", str(default_model_dir), "--policy", "quest")
    assert code == 2 and "layerwise" in err


@pytest.mark.parametrize("policy,flags", [("minference", ["--minference-vertical", "0.1", "--minference-slash", "0.2"]),
                                          ("xattention", ["--xattention-threshold", "0.8", "--xattention-stride", "8"])])
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
