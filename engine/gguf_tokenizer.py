"""The tokenizer files of a GGUF model, built from its metadata with the `tokenizers` library.

transformers can read a GGUF tokenizer itself, but what it makes of one changes between its versions
(4.45 and 5.17 read eos id 1 from SmolLM2's file; 5.23 drops the digit split of its pre-tokenizer).
Building tokenizer.json and tokenizer_config.json here makes the converted folder the same whatever
transformers is installed, and every version from 4.45 on loads it with AutoTokenizer. Only
byte-level BPE ("gpt2") tokenizers are known: what the llama-family GGUF files carry. Qt-free.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelError

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) that first split off every digit (regex \p{N}),
# then apply GPT-2's regex to the pieces: Hugging Face's Digits(individual_digits) + ByteLevel. It matters
# for whitespace before a digit: "\n\n4" is "\n\n", "4" (GPT-2's regex alone: "\n", "\n", "4").
_DIGITS_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_PLAIN = {"gpt-2", "mpt", "olmo", "jais"}   # GPT-2's regex alone
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are added (never split) tokens


@dataclass
class GGUFTokenizer:
    tokenizer: object  # tokenizers.Tokenizer
    config: dict       # tokenizer_config.json

    def save(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")


def read_tokenizer(reader, src: Path, model_max_length: int) -> GGUFTokenizer:
    """The tokenizer in the metadata of an open gguf.GGUFReader of the file src."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    def scalar(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0].name == "STRING" else value[0].item()

    def array(key: str) -> list:
        f = reader.fields.get(key)
        if f is None:
            raise ModelError(f"{src} lacks the tokenizer metadata {key}; it may be damaged.")
        if f.types[-1].name == "STRING":
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]

    if (kind := scalar("tokenizer.ggml.model")) is None:
        raise ModelError(f"{src} lacks the tokenizer metadata tokenizer.ggml.model; it may be damaged.")
    if kind != "gpt2":
        raise ModelError(f"{src} has a {kind!r} tokenizer; the converter knows byte-level BPE only.")
    pre = scalar("tokenizer.ggml.pre")
    if pre not in _DIGITS_SPLIT | _PLAIN:
        raise ModelError(f"{src} uses the pre-tokenizer {pre!r}, which the converter does not know.")
    tokens, types = array("tokenizer.ggml.tokens"), array("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in array("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise ModelError(f"{src}: the tokenizer's tokens, types and merges do not fit together; "
                         "it may be damaged.")
    template = scalar("tokenizer.chat_template")
    if not template:
        raise ModelError(f"{src} carries no chat template (tokenizer.chat_template); the app "
                         "needs one to chat.")

    def token(key: str) -> str | None:
        i = scalar(f"tokenizer.ggml.{key}_token_id")
        if i is not None and not 0 <= i < len(tokens):
            raise ModelError(f"{src}: the {key} token id {i} is outside the vocabulary.")
        return None if i is None else tokens[i]

    bos, eos, unk, pad = token("bos"), token("eos"), token("unknown"), token("padding")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(scalar("tokenizer.ggml.add_space_prefix", False)), use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level]) if pre in _DIGITS_SPLIT else byte_level)
    tok.decoder = decoders.ByteLevel()
    add_bos = bool(scalar("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(scalar("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = [bos] * add_bos + ["$A"] + [eos] * add_eos
    pair = single + [bos] * add_bos + ["$B:1"] + [eos] * add_eos
    specials = [(t, vocab[t]) for t in dict.fromkeys([bos] * add_bos + [eos] * add_eos)]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=specials)
    # Control tokens (<|im_start|>, ...) are special: matched whole, dropped by skip_special_tokens.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelError(f"{src}: the tokenizer's added tokens are not in its vocabulary.")

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": add_bos,
              "add_eos_token": add_eos, "chat_template": template}
    config.update({f"{name}_token": t for name, t in
                   (("bos", bos), ("eos", eos), ("unk", unk), ("pad", pad)) if t is not None})
    return GGUFTokenizer(tok, config)
