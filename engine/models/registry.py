"""Which architectures we run, and the few numbers we need from a Hugging Face `config.json`.

Config files come in two shapes: older ones carry `rope_theta` / `rope_scaling` at the top level, files written
by transformers 5 carry `rope_parameters`. Both are read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelError
from engine.layers.rotary import SUPPORTED_ROPE_TYPES

# architecture -> (qkv bias default, q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),    # Llama 2/3.x, SmolLM2
    "Qwen2ForCausalLM": (True, False),     # qkv bias
    "Qwen3ForCausalLM": (False, True),     # q/k norm
}


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, per byte of element size (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def parse_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelError(f"{source}: architecture {', '.join(archs) or cfg.get('model_type', '?')} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    if cfg.get("use_sliding_window"):
        raise ModelError(f"{source}: sliding-window attention is not supported (set use_sliding_window false)")
    qkv_bias_default, qk_norm = ARCHITECTURES[arch]
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
                raise ModelError(f"{source}: rope scaling {scaling['rope_type']!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        return ModelArgs(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", qkv_bias_default)),
            qk_norm=qk_norm,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        )
    except KeyError as e:
        raise ModelError(f"{source}: required field {e.args[0]!r} is missing; is this a complete model config?") from None


def read_config(model_dir: Path) -> ModelArgs:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelError(f"{model_dir}: no config.json; point --model at a Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot be read as JSON ({e}); the file may be corrupt") from None
    return parse_config(cfg, str(path))

