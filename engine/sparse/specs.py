"""What each sparse-attention policy is and what it takes: one `PolicySpec` per policy, torch-free.

This table is the one source of every policy's parameters. The engine's registry (`make_policy`) validates
against it and fills defaults from it, the command line's `--<policy>-<param>` flags are generated from it
(app/cli.py), and so is the GUI policy panel's form (widgets/policy_panel.py). A default lives here and
nowhere else.

Adding a policy (README, "Adding a policy"): write its module in engine/sparse/, add its spec below, add its test.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module

from engine.errors import ConfigError

MODES = ("gpu", "layerwise", "chunked")
OFFLOAD = ("layerwise", "chunked")


@dataclass(frozen=True)
class Param:
    name: str
    type: type                          # int, float or bool
    default: int | float | bool
    min: float | None = None            # inclusive, unless min_open
    max: float | None = None
    help: str = ""
    label: str = ""                     # the panel's row label (default: the name, capitalised)
    choices: tuple = ()                 # allowed values (a combo box in the panel)
    min_open: bool = False              # min is exclusive: (min, max]
    flag: str = ""                      # the CLI flag without '--' (default: <policy>-<name with dashes>)
    aliases: tuple[str, ...] = ()       # other CLI flags for it (kept for old command lines)
    panel: bool = True                  # shown in the GUI panel (internals stay CLI/library only)
    step: float = 1                     # the panel's spin box step
    special: str = ""                   # what the panel shows at the minimum (e.g. "auto" for 0)

    def describe_range(self) -> str:
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.type is bool:
            return "true or false"
        lo = "(" if self.min_open else "["
        hi = "inf" if self.max is None else _num(self.max)
        return f"{lo}{_num(self.min) if self.min is not None else '-inf'}, {hi}]"

    def check(self, policy: str, value):
        """-> the value as this parameter's type; ConfigError naming the parameter and its range otherwise."""
        where = f"{policy} {self.name}"
        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, (int, float)) and value in (0, 1):
                return bool(value)
            raise ConfigError(f"{where} must be true or false (got {value!r})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number in {self.describe_range()} (got {value!r})")
        if self.type is int:
            if value != int(value):
                raise ConfigError(f"{where} must be a whole number in {self.describe_range()} (got {value!r})")
            value = int(value)
        else:
            value = float(value)
        if self.choices and value not in self.choices:
            raise ConfigError(f"{where} must be {self.describe_range()} (got {_num(value)})")
        low = self.min is not None and (value <= self.min if self.min_open else value < self.min)
        if low or (self.max is not None and value > self.max):
            raise ConfigError(f"{where} must be in {self.describe_range()} (got {_num(value)})")
        return value


@dataclass(frozen=True)
class PolicySpec:
    name: str
    title: str                          # shown name
    phase: str                          # "prefill", "decode" or "both" (full)
    modes: tuple[str, ...]              # execution modes it runs in
    help: str                           # what it does (the panel's tooltip, the CLI help)
    impl: str                           # "module:Class" of its implementation (imported on first use)
    why_not: str = ""                   # why it does not run in the other modes
    params: tuple[Param, ...] = field(default_factory=tuple)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.params) or "none"
        raise ConfigError(f"the {self.name} policy has no parameter {name!r} (its parameters: {known})")

    def defaults(self) -> dict:
        return {p.name: p.default for p in self.params}

    def validate(self, params: dict | None) -> dict:
        """Every parameter checked against its range, the missing ones filled with their defaults."""
        out = self.defaults()
        for name, value in (params or {}).items():
            out[name] = self.param(name).check(self.name, value)
        return out

    def check_mode(self, mode: str) -> None:
        if mode not in self.modes:
            modes = " or ".join(self.modes)
            raise ConfigError(f"the {self.name} policy runs in {modes} mode, not {mode}: {self.why_not} "
                              f"(choose --mode {' or --mode '.join(self.modes)})")


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


_DENSE_BELOW = ("prompts (keys of a layer) shorter than this many tokens run dense prefill: sparsity only pays on "
                "long prompts")

def _dense_gate(cpu: float) -> tuple[Param, Param]:
    """The prefill policies' dense gate (engine/sparse/policy.py: SparsePrefillPolicy); `cpu`: its default off CUDA,
    measured per policy with `python -m bench --lengths 2048,4096,7000 --text sample` (XAttention's whole-block
    gathers pay up to a higher share than MInference's token-level ones)."""
    return (
        Param("cpu_dense_above", float, cpu, 0, 1, "off CUDA: a layer whose pattern keeps more than this share of the "
              "causal pairs runs dense, and the stats say so (the CPU's gathered path is slower than dense attention "
              "there; measured with bench --text sample). 1 = always sparse, to study the masks.",
              "CPU: dense above", step=0.05),
        Param("gpu_dense_above", float, 0.45, 0, 1, "on CUDA: a layer whose pattern keeps more than this share of "
              "the causal pairs runs dense, and the stats say so (on the H100 our kernels compute a pair at 0.2-0.8x "
              "the pace of dense cuDNN attention, vertical-slash at the low end: bench --kernels; with the "
              "estimate's cost a layer pays below about this share). 1 = always sparse.", "GPU: dense above", step=0.05))

SPECS: dict[str, PolicySpec] = {s.name: s for s in (
    PolicySpec("full", "Full", "both", MODES, "Dense attention over every token: the exact baseline.",
               "engine.sparse.policy:FullPolicy"),
    PolicySpec(
        "quest", "Quest", "decode", OFFLOAD,
        "Decode policy: per step and kv head, loads only the KV pages whose key bounds promise the highest "
        "attention scores for the current query (less host-to-GPU traffic).",
        "engine.sparse.quest:QuestPolicy",
        "it chooses which host KV pages to load at each decode step; in gpu mode all KV is already on the device",
        (Param("token_budget", int, 2048, 32, 1 << 22, "KV tokens attended per decode step, layer and kv head, "
               "everything counted: the sink, the pages chosen by score, and the recent window that ends at the new "
               "token (it takes what whole pages leave over, and starts at a page boundary: the lowest-scored page "
               "gives it the tokens that needs, so the count is exact). Smaller = faster, less exact; "
               "1024-4096 is typical.", "Token budget", aliases=("quest-budget",), step=256),
         Param("page_size", int, 16, help="tokens per page, the unit whose key min/max bounds are scored; it must "
               "divide the KV block size. Smaller pages select more precisely and cost more metadata.",
               label="Page size", choices=(16, 32, 64, 128), aliases=("quest-page",)),
         Param("sink", int, 16, 0, 1 << 16, "first tokens always attended (the attention sink; rounded up to "
               "whole pages)", "Sink tokens", step=16),
         Param("recent", int, 32, 1, 1 << 16, "newest tokens always attended, at least (the window ending at the "
               "new token)", "Recent tokens", step=16),
         Param("dense_layers", int, 2, 0, 1024, "the first layers attend densely (their attention is spread out, "
               "so page selection hurts them most); 2 is the usual choice.", "Dense layers"),
         Param("min_context", int, 8192, 0, 1 << 24, "below this context (tokens) every layer loads all its KV: "
               "there one contiguous copy costs less than scoring and gathering pages (the stats say so)",
               "Dense below (tokens)", step=1024),
         Param("min_layer_mb", float, 32, 0, 1 << 20, "and while a layer's KV at the context is under this many MiB "
               "(per token 2 x kv heads x head_dim x bytes per element), every layer loads all of it: Quest's scoring "
               "and gathers cost a fixed ~0.4 ms per layer on the host. Measured on an H100, layerwise, budget 2048, "
               "Full against Quest: the Qwen3-4B shape (4 KiB per token and layer) 11.7 against 16.0 ms/token at 4K "
               "tokens (16 MiB), 22.4 against 18.2 at 8K (32 MiB), 44.4 against 19.2 at 16K; the default model (768 "
               "B per token) at 6K, 4.5 MiB: 4.8-6.8 against 15.8-16.5 (budget 1024). So a small model stays dense.",
               "Dense below (MiB per layer)", step=4),
         Param("look_ahead", bool, False, help="layerwise mode: guess each layer's query one layer early from the "
               "residual stream and fetch the pages it chooses on the copy stream before the layer runs (the "
               "layer's own query then corrects what is left). Off by default: the second choice per layer costs "
               "more than the exposed correction it saves (H100, Qwen3-4B shape, 128K: 22.8 against 18.7 ms/token)",
               label="Fetch one layer ahead"),
         Param("bound_tokens", int, 0, 0, 128, "tokens per key bound (0: the page size; else a divisor of it): a "
               "page keeps the key min/max of each of its parts of this many tokens and scores by the largest of "
               "their bounds. Smaller parts bound the page's best key more tightly (the bound of 16 tokens is "
               "loose where each dimension's extreme comes from another token) and cost page_size / bound_tokens "
               "times the metadata.", "Tokens per bound", choices=(0, 1, 2, 4, 8, 16, 32, 64, 128)),
         Param("rank", int, 32, 0, 256, "r > 0: each key is kept on the device in the r leading directions of its "
               "layer's keys (per kv head) and a page scores by the largest of its tokens' logits estimated there "
               "(Loki's low-rank keys). 0: pages are scored by their key bounds (the Quest paper's min/max). On "
               "post-RoPE keys the bounds overshoot a page's best logit several times over and rank pages by spread, "
               "not by the query: on the default model's needle grid (2K-7K tokens, CPU fp32 and GPU bf16) the bounds "
               "lose 4 of the cells full attention finds at budget 512 and 1 at 1024, rank 32 none at 512 and 1 at "
               "1024. Costs r values per token and kv head on the device (the bounds: head_dim / 8 at 16-token "
               "pages) and ~3% of a Qwen3-4B-shape decode step (H200, 32K and 128K, budget 2048).",
               "Low-rank key score (0: bounds)", step=4),
         Param("centroid", bool, False, help="score a page by the mean of its key bound and its mean key's score "
               "(q·mean), not by the bound alone: the bound overrates pages with one outlying key, the mean "
               "underrates pages with one strong one. On the default model at a 7K-token needle it kept the "
               "attention mass a per-layer oracle keeps in the layer that decides the answer (0.996 against 0.970 "
               "with the bound); costs a third more page metadata and, on CUDA, a torch gather per layer.",
               label="Score with the mean key"),
         Param("recall", bool, False, help="measure recall each step: the share of the true attention mass on "
               "what was attended, from the layer's whole K read back from the host (slow; for study)",
               label="Measure recall"))),
    PolicySpec(
        "minference", "MInference", "prefill", ("gpu", "layerwise"),
        "Prefill policy: attends to a few vertical lines (key columns) and slash lines (diagonals) estimated "
        "from the last queries, skipping the rest of the attention matrix.",
        "engine.sparse.minference:MInferencePolicy",
        "it needs a layer's whole prompt at once to estimate its pattern, and chunked mode prefills block by block",
        (Param("vertical", float, 1000, 0, 1 << 22, "key columns (vertical lines) every query attends to, picked "
               "from the last queries' scores (the sink columns always): a count, or a fraction of the prompt if "
               "at most 1. Typical 500-2000.", "Vertical lines", min_open=True, step=100),
         Param("slash", float, 6096, 0, 1 << 22, "diagonals (slash lines: fixed query-key distances) every query "
               "attends to (the recent ones always): a count, or a fraction of the prompt if at most 1. Typical "
               "2000-8000.", "Slash lines", min_open=True, step=256),
         Param("min_len", int, 8192, 1, 1 << 24, _DENSE_BELOW, "Dense below (tokens)", flag="sparse-min-len",
               step=1024),
         Param("last_q", int, 64, 16, 4096, "queries at the end of the prompt whose attention estimates the "
               "pattern", panel=False),
         Param("sink", int, 64, 0, 1 << 20, "first key columns always kept", panel=False),
         Param("recent", int, 128, 0, 1 << 20, "nearest diagonals always kept", panel=False),
         Param("block", int, 128, help="kernel tile of the pattern (tokens)", choices=(16, 32, 64, 128),
               panel=False),
         *_dense_gate(0.35))),
    PolicySpec(
        "xattention", "XAttention", "prefill", ("gpu", "layerwise"),
        "Prefill policy: scores attention blocks by the sums of their antidiagonals and computes only the "
        "blocks needed to reach the threshold of attention mass.",
        "engine.sparse.xattention:XAttentionPolicy",
        "it needs a layer's whole prompt at once to score its blocks, and chunked mode prefills block by block",
        (Param("threshold", float, 0.9, 0, 1, "tau: keep the highest-scoring key blocks of each query block until "
               "they hold this share of the attention mass. Higher = more exact, slower; 0.8-0.95 is typical.",
               "Threshold τ", min_open=True, step=0.05),
         Param("stride", int, 16, help="antidiagonal stride used to score the blocks (it divides the block): "
               "larger is cheaper to score and coarser; 8 or 16 is typical.", label="Stride",
               choices=(1, 2, 4, 8, 16, 32, 64)),
         Param("min_len", int, 0, 0, 1 << 24, _DENSE_BELOW + ". 0 = auto: 4096 on a CPU (its gathered path pays "
               "from about 4K tokens on the default model: bench --text sample), 8192 on CUDA (our kernels break "
               "even there on real attention)", "Dense below (tokens)", flag="sparse-min-len", step=1024,
               special="auto"),
         Param("block", int, 128, help="block size of the sparse pattern (tokens)", choices=(16, 32, 64, 128, 256),
               panel=False),
         Param("chunk_rows", int, 2048, 1, 1 << 20, "query rows scored at once (bounds the estimate's memory)",
               panel=False),
         *_dense_gate(0.6))),
    PolicySpec(
        "streamingllm", "StreamingLLM", "decode", OFFLOAD,
        "Decode policy: attends to the first tokens (the attention sink) and a window of the most recent ones, "
        "and never loads the rest: the baseline every sparse-attention paper compares against.",
        "engine.sparse.streaming:StreamingLLMPolicy",
        "it chooses which host KV pages to load at each decode step; in gpu mode all KV is already on the device",
        (Param("sink", int, 64, 0, 1 << 20, "first tokens always attended (the attention sink)", "Sink tokens",
               step=16),
         Param("window", int, 1024, 1, 1 << 22, "newest tokens attended (the window ends at the new token)",
               "Window tokens", step=256))),
)}


def get_spec(name: str) -> PolicySpec:
    if name not in SPECS:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(SPECS)}")
    return SPECS[name]


def policy_class(name: str):
    module, cls = get_spec(name).impl.split(":")
    return getattr(import_module(module), cls)


def make_policy(name: str, params: dict | None, mode: str):
    """A policy by name with its parameters (validated against its spec), for an engine in `mode`; one clear
    ConfigError for an unknown name or parameter, a value out of range, or a mode it cannot run in."""
    spec = get_spec(name)
    spec.check_mode(mode)
    return policy_class(name)(**spec.validate(params))   # constraints between parameters: ConfigError there too
