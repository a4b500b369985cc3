"""Engine settings, validated up front with messages that say what to change."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from engine.errors import ConfigError

MODES = ("gpu", "layerwise", "chunked")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None            # Hugging Face folder; None = the embedded default model
    shape: dict | None = None           # config.json values of a model: random weights of its shape (bench.shapes)
    device: str | None = None           # "cuda", "cuda:1", "cpu"; None = cuda when available
    dtype: str | None = None            # None = bf16 on GPU, fp32 on CPU
    mode: str = "gpu"                   # where KV lives (DESIGN.md §2.1)
    max_model_len: int | None = None    # None = the model's own context length
    max_num_seqs: int | None = None     # sequences decoded together: None = 16 in gpu mode, 1 in offload modes
    max_num_batched_tokens: int | None = None  # tokens batched per prefill step; None = min(max_model_len, 32K)
    kv_block_size: int = 256            # tokens per paged KV block (prefix-cache granularity)
    num_kv_blocks: int | None = None    # None = sized from memory (gpu_memory_utilization / cpu_kv_cache_gb)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 4.0
    ring_slots: int = 3                 # offload modes: device buffers in the ring (layers, or blocks in chunked)
    gpu_kv_budget_gb: float | None = None  # layerwise: device memory for KV; layers that fit stay resident
    host_kv_gb: float | None = None     # offload modes: host KV pool; None = one sequence of max_model_len
    prefill_chunk_tokens: int | None = None  # layerwise prefill: rows per QKV / MLP chunk (bounds activations);
                                             # None = as many as keep the MLP's under 256 MiB, at least 8192
    policy: str = "full"                # sparse attention policy (engine.sparse): full | quest
    policy_params: dict = field(default_factory=dict)  # e.g. {"token_budget": 2048, "page_size": 32}
    enforce_eager: bool = False         # True = no CUDA graphs for decode
    torch_threads: int | None = None    # CPU threads for torch; None = torch's default
    kv_store: str | None = None         # disk KV tier: a folder ("default" = the user cache's kvscope/kv); None = off
    kv_store_gb: float = 20.0           # its size limit (least recently used pages go first)
    seed: int = 0                       # for random weights (--shape)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.max_num_seqs is None:
            self.max_num_seqs = 16 if self.mode == "gpu" else 1
        elif self.mode != "gpu" and self.max_num_seqs > 1:
            raise ConfigError(f"{self.mode} mode runs one sequence at a time (max_num_seqs={self.max_num_seqs} was "
                              "asked for): use mode='gpu' to batch sequences, or max_num_seqs=1")
        if self.ring_slots < 1:
            raise ConfigError(f"ring_slots must be at least 1 (got {self.ring_slots})")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be at least 1 (got {self.prefill_chunk_tokens})")
        for name in ("gpu_kv_budget_gb", "host_kv_gb"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive (got {getattr(self, name)})")
        if self.kv_block_size < 16 or self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError(f"kv_block_size must be a power of two >= 16 (got {self.kv_block_size})")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1 (got {value})")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ConfigError(f"gpu_memory_utilization must be in [0.05, 0.99] (got {self.gpu_memory_utilization})")
        if self.model is not None and self.shape is not None:
            raise ConfigError("give either a model folder or a --shape for random weights, not both")
        if self.shape is not None and not isinstance(self.shape, dict):
            raise ConfigError(f"shape takes a model's config.json values as a dict (bench.shapes.shape_config(name) "
                              f"gives the known ones), not {type(self.shape).__name__}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def resolve_device(self) -> torch.device:
        name = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {name} was asked for, but this machine has no CUDA device "
                              "(or torch was built without CUDA): use --device cpu")
        if device.type not in ("cuda", "cpu"):
            raise ConfigError(f"unsupported device {name!r}: use cuda or cpu")
        if device.type == "cuda" and device.index is None:   # an explicit index: torch's stream and event calls
            device = torch.device("cuda", torch.cuda.current_device())   # take a slow path to find it otherwise
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_config(**config) -> None:
    """The cheap checks of an engine's settings, without loading anything: every setting's range, the policy (its
    mode, each parameter against its spec) and the model folder (it exists, its config.json names a supported
    architecture, it has tokenizer files). The app and the command line run them before loading. Raises
    ModelError/ConfigError."""
    from engine.model_folder import check_tokenizer_files, resolve_model_dir
    from engine.models.registry import read_config
    from engine.sparse import get_spec
    cfg = EngineConfig.from_kwargs(**config)
    spec = get_spec(cfg.policy)
    spec.check_mode(cfg.mode)
    spec.validate(cfg.policy_params)
    if cfg.model is not None:
        folder = resolve_model_dir(cfg.model, None)
        read_config(folder)
        check_tokenizer_files(folder)
