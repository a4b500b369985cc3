"""The model folder an engine loads: where it is (a Hugging Face folder given as --model, or the embedded default
model, converted on first use) and the tokenizer in it. Qt-free."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelError

if TYPE_CHECKING:
    from engine.defaults import Progress


def resolve_model_dir(model: str | None, progress: Progress | None) -> Path:
    """The folder `model` names (ModelError if it is not one), or for None the default model's, converted on first
    use (`progress` hears the conversion)."""
    if model is None:
        from engine.defaults import ensure_default_model
        return ensure_default_model(progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}; --model takes a Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files), or leave it out for the default model")
    return path


VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _has_vocabulary(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in VOCAB_FILES)


def check_tokenizer_files(model_dir: Path) -> None:
    """ModelError unless the folder has a vocabulary file: a chat needs text in and out (the engine alone does not)."""
    if not _has_vocabulary(model_dir):
        raise ModelError(f"{model_dir}: no tokenizer files; a chat needs tokenizer.json, or tokenizer.model with "
                         "tokenizer_config.json, beside config.json")


def _tokenizer_class(model_dir: Path):
    """transformers' PreTrainedTokenizerFast where tokenizer_config.json names it (the default model, Llama 3): ~1.5 s
    sooner than AutoTokenizer, which reads the model's config first and imports its model code. Else AutoTokenizer."""
    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named == "PreTrainedTokenizerFast" and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer
    return AutoTokenizer


def load_tokenizer(model_dir: Path):
    """The folder's tokenizer (transformers' AutoTokenizer, from local files only), without a length limit; None
    where the folder has no vocabulary file (the engine then takes token ids only: transformers 5 would hand back
    an empty tokenizer that encodes every text to nothing, transformers 4 an error)."""
    if not _has_vocabulary(model_dir):
        return None
    try:
        tok = _tokenizer_class(model_dir).from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ModelError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {str(e)[:200]}); the folder "
                         "needs tokenizer.json or tokenizer.model with tokenizer_config.json") from None
    if len(tok) < 2:
        raise ModelError(f"{model_dir}: its tokenizer files hold no vocabulary; the folder needs tokenizer.json or "
                         "tokenizer.model with tokenizer_config.json")
    tok.model_max_length = 1 << 40  # the engine checks lengths itself, against the real limits, with better words
    return tok


def eos_ids(config_ids, tokenizer, model_dir: Path | None) -> set[int]:
    """The token ids that end an answer: the model config's, the tokenizer's, and generation_config.json's."""
    ids = set(config_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = model_dir / "generation_config.json" if model_dir else None
    if gen and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
