"""The default model's tokenizer, built from its GGUF metadata (engine/gguf_tokenizer.py): the same files whatever
transformers is installed, the ids and chat template the model was trained with, one clear error where it cannot."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from engine.defaults import find_default_gguf
from engine.errors import ModelError
from engine.gguf_tokenizer import read_tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = ["Hello, world!", "naïve café 日本語 👩‍👩‍👧 مرحبا", "e\u0301 \x00\t tab", "def f(x):\n    return x**2\n",
         "  two  spaces\n\n\nthree lines \r\n", "The year 2024, pi = 3.14159", "a" * 300, ""]


@pytest.fixture(scope="module")
def converted_tokenizer(default_model_dir):
    """The converted folder's tokenizer, loaded the way the engine loads it."""
    from engine.model_folder import load_tokenizer
    return load_tokenizer(default_model_dir)


def test_tokenizer_files_come_from_the_gguf_alone(default_model_dir, tmp_path, monkeypatch):
    """No transformers involved: what a user's transformers version does with GGUF files cannot matter."""
    from gguf import GGUFReader

    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of transformers now fails
    src = find_default_gguf()
    read_tokenizer(GGUFReader(src), src, 8192).save(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (default_model_dir / name).read_bytes(), name
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 8192
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")


def test_tokenizer_special_tokens_and_known_ids(converted_tokenizer):
    tok = converted_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert len(tok) == 49152
    ids = tok.encode("Hello, world!")                   # SmolLM2 adds no bos or eos of its own
    assert ids == [19556, 28, 905, 17]
    assert tok.convert_ids_to_tokens(ids) == ["Hello", ",", "Ġworld", "!"]   # Ġ: GPT-2's byte for " "
    # the 17 control tokens are whole tokens, and skip_special_tokens drops them
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><repo_name>")
    assert ids[0] == 1 and ids[-2:] == [2, 3] and tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_tokenizer_splits_every_digit_like_llama_cpp_smollm(converted_tokenizer):
    """The GGUF names its pre-tokenizer "smollm": each digit is split off before GPT-2's regex, so
    whitespace before a digit stays one piece. The vocabulary agrees: it has no token with a digit in
    it besides the ten digits themselves (so they were split off when it was trained)."""
    tok = converted_tokenizer
    vocab = tok.get_vocab()
    assert sorted(t for t in vocab if set(t) & set("0123456789")) == list("0123456789")
    assert tok.tokenize("The year 2024") == ["The", "Ġyear", "Ġ", "2", "0", "2", "4"]
    assert tok.tokenize("Step\n\n4.") == ["Step", "ĊĊ", "4", "."]     # GPT-2's regex: "Ċ", "Ċ", "4"
    assert tok.tokenize("a  1") == ["a", "ĠĠ", "1"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(converted_tokenizer, text):
    tok = converted_tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_im_start_turns(converted_tokenizer):
    tok = converted_tokenizer
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == tok.encode(text) and ids.count(1) == 3 and ids.count(2) == 2
    assert ids[:3] == [1, 9690, 198]                        # <|im_start|> system \n
    assert tok.convert_ids_to_tokens(ids[-4:]) == ["<|im_start|>", "ass", "istant", "Ċ"]
    system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    text = tok.apply_chat_template(system, tokenize=False, add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and SYSTEM not in text
    assert text.endswith("<|im_end|>\n")


def _tiny_tokenizer_gguf(path: Path, *, pre: str = "smollm", template: str | None = "{{ messages }}"):
    """A GGUF file with only a byte-level BPE tokenizer: two control tokens, a few bytes, two merges."""
    import gguf

    tokens = ["<s>", "</s>", "a", "b", "Ġ", "1", "Ċ", "ab", "Ġab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_tokenizer_of_a_tiny_gguf(tmp_path):
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    src = _tiny_tokenizer_gguf(tmp_path / "tok.gguf")
    built = read_tokenizer(GGUFReader(src), src, 64)
    built.save(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    enc = tok.encode("ab ab1<s>")
    assert enc.tokens == ["<s>", "ab", "Ġab", "1", "<s>"] and enc.ids == [0, 7, 8, 5, 0]  # bos added
    assert tok.decode(enc.ids) == "ab ab1"
    assert built.config["add_bos_token"] is True and built.config["chat_template"] == "{{ messages }}"


@pytest.mark.parametrize("kind, phrase", [("template", "no chat template"),
                                          ("pre", "pre-tokenizer 'llama-bpe'")])
def test_tokenizer_the_converter_cannot_build_is_one_clear_error(tmp_path, kind, phrase):
    from gguf import GGUFReader

    src = _tiny_tokenizer_gguf(tmp_path / "tok.gguf", **({"template": None} if kind == "template"
                                                          else {"pre": "llama-bpe"}))
    with pytest.raises(ModelError, match=re.escape(phrase)) as info:
        read_tokenizer(GGUFReader(src), src, 64)
    assert str(src) in str(info.value) and "\n" not in str(info.value)
