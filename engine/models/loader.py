"""Build a model and fill it from a Hugging Face folder (single or sharded *.safetensors, memory-mapped),
or with random weights of a real model's shape for benchmarks."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn
from safetensors import safe_open

from engine.errors import ModelError
from engine.layers.rotary import rope_inv_freq
from engine.models.llama import CausalLM
from engine.models.registry import ModelArgs

# checkpoint tensors that land in a slice of one of our fused parameters: name -> (our name, slice index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def build_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> CausalLM:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the target dtype: no fp32 copy on the device
    try:
        with torch.device("meta"):
            model = CausalLM(args)
    finally:
        torch.set_default_dtype(default)
    for module in model.modules():   # (not to_empty: its empty_like on meta tensors imports torch's meta
        for group in (module._parameters, module._buffers):     # registrations, ~1 s of a CPU's start)
            for name, t in group.items():
                if t is not None:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    group[name] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
    if args.tie_word_embeddings:  # new parameters break the tie; restore it
        model.lm_head.weight = model.embed_tokens.weight
    # buffers computed at init were replaced by empty ones
    model.rotary.inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    return model.eval().requires_grad_(False)


def random_weights(model: CausalLM, seed: int = 0) -> CausalLM:
    """Weights drawn like a trained model's scale (std 0.02, norms 1): for speed measurements only."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(0.02))
    return model


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{index}: unreadable shard index ({e}); re-download the model") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}; "
                             "re-download the model")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = " (only PyTorch .bin weights found: convert them to safetensors)" if any(model_dir.glob("*.bin")) else ""
        raise ModelError(f"{model_dir}: no *.safetensors weight files{extra}")
    return files


def load_weights(model: CausalLM, model_dir: Path) -> CausalLM:
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {name: 0 for name in params}
    tied = model.args.tie_word_embeddings
    for path in safetensor_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    target = _target(key, tied)
                    if target is None:
                        continue
                    name, part = target
                    if name not in params:
                        raise ModelError(f"{path.name}: tensor {key} does not fit this architecture")
                    filled[name] += _copy_into(params[name], part, f.get_tensor(key), model.args, key, path)
        except ModelError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged files
            raise ModelError(f"{path}: cannot read the weights ({e}); the file is corrupt or truncated, "
                             "re-download it") from None
    if tied:
        filled["lm_head.weight"] = filled["embed_tokens.weight"]
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ModelError(f"{model_dir}: weights missing for {len(missing)} parameter(s), e.g. {', '.join(missing[:3])}")
    return model


def _target(key: str, tied: bool) -> tuple[str, int | None] | None:
    """Checkpoint name -> (our parameter name, fused slice index or None); None = not ours to load."""
    if key == "lm_head.weight":
        return None if tied else ("lm_head.weight", None)
    m = _LAYER.match(key)
    if m:
        layer, block, proj, kind = m.groups()
        if proj in _FUSED:
            fused, part = _FUSED[proj]
            return f"layers.{layer}.{block}.{fused}.{kind}", part
        return f"layers.{layer}.{block}.{proj}.{kind}", None
    if key.startswith("model."):
        return key[len("model."):], None
    return None


def _copy_into(param: torch.Tensor, part: int | None, src: torch.Tensor, a: ModelArgs, key: str, path: Path) -> int:
    if part is None:
        dst = param
    else:
        if "qkv_proj" in key or key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                              "q_proj.bias", "k_proj.bias", "v_proj.bias")):
            sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        else:
            sizes = [a.intermediate_size, a.intermediate_size]
        start = sum(sizes[:part])
        dst = param.narrow(0, start, sizes[part])
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelError(f"{path.name}: tensor {key} has shape {tuple(src.shape)}, the config implies "
                         f"{tuple(dst.shape)}; config.json and weights do not match")
    dst.copy_(src)
    return src.numel()
