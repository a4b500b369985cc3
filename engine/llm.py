"""LLM: load a model, then generate, stream and count tokens. The one entry point of the engine."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.control import TaskState
from engine.errors import Cancelled, ConfigError, ContextTooLongError, ModelError, OutOfMemoryError
from engine.model_runner import ModelRunner
from engine.offload.tier import kv_identity, open_tier
from engine.models.loader import build_model, load_weights, random_weights
from engine.models.registry import parse_config, read_config, shape_config
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.trace.events import DECODE, HOST, LOAD, PREFILL, TOKENIZE
from engine.trace.recorder import NULL_RECORDER, Recorder

Progress = Callable[[float, str], None]


@dataclass
class GenerationStats:
    prompt_tokens: int
    cached_tokens: int          # prompt tokens whose KV came from the prefix cache
    completion_tokens: int
    ttft_s: float               # request start (incl. tokenization) to the first answer token
    prefill_tok_s: float        # computed (uncached) prompt tokens per second of prefill
    decode_tok_s: float         # answer tokens after the first, per second
    total_s: float
    finish_reason: str          # stop | length | cancelled
    bytes_h2d: int = 0          # KV bytes moved host -> device for this request (offload modes)
    bytes_d2h: int = 0          # KV bytes moved device -> host
    disk_cached_tokens: int = 0  # of the cached tokens, those read from the disk tier
    policy_stats: dict = field(default_factory=dict)  # the sparse policy's figures (density, pages selected, ...)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StreamChunk:
    text: str                              # new answer text ("" in the final chunk)
    stats: GenerationStats | None = None   # set in the final chunk only


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class LLM:
    def __init__(self, model: str | None = None, progress: Progress | None = None,
                 recorder: Recorder | None = None, **config):
        self.config = EngineConfig.from_kwargs(model=model, **config)
        cfg = self.config
        rec = self._recorder = recorder or NULL_RECORDER
        if rec.enabled:
            rec.begin_step(LOAD)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = cfg.resolve_device()
        self.dtype = cfg.resolve_dtype(self.device)
        self.tokenizer = None
        if cfg.shape is not None:
            self.model_dir, self.model_name = None, f"random weights, {cfg.shape} shape"
            args = parse_config(shape_config(cfg.shape), f"--shape {cfg.shape}")
        else:
            self.model_dir = _resolve_model_dir(cfg.model, progress)
            self.model_name = self.model_dir.name
            args = read_config(self.model_dir)
            self.tokenizer = _load_tokenizer(self.model_dir)
        self.args = args
        self.max_model_len = cfg.max_model_len or args.max_position_embeddings
        if self.max_model_len > args.max_position_embeddings and cfg.shape is None:  # random weights: any length
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context of "
                              f"{args.max_position_embeddings} tokens")
        if progress:
            progress(0.0, f"loading {self.model_name} on {self.device} ({str(self.dtype).removeprefix('torch.')})")
        try:
            with rec.span(HOST, "load weights"):
                model = build_model(args, self.device, self.dtype)
                if self.model_dir is None:
                    random_weights(model, cfg.seed)
                else:
                    load_weights(model, self.model_dir)
            self.runner = _make_runner(model, cfg, self.device, self.dtype, self.max_model_len, rec)
        except torch.OutOfMemoryError:
            raise OutOfMemoryError(f"{self.model_name} does not fit in {self.device} memory in "
                                   f"{str(self.dtype).removeprefix('torch.')}: use a smaller model or --device cpu") from None
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.kv_block_size)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, self.runner.max_num_batched_tokens,
                                   self._eos_ids(), self.max_model_len)
        self.tier = open_tier(self)            # the disk KV tier (config.kv_store), or None
        if rec.enabled:
            rec.end_step(self._memory_metrics())
        self.plan = getattr(self.runner, "plan", None)   # layerwise: which layers stay on the device
        if progress:
            if self.plan is not None:
                progress(1.0, self.plan.describe())
            progress(1.0, "ready")

    def set_policy(self, name: str, params: dict | None = None) -> None:
        """Switch the sparse policy between requests. The prefix cache is dropped: KV (and Quest's page metadata)
        made under another policy would otherwise be reused, and the next prompt would not really run the new one."""
        from engine.sparse import make_policy
        if not self.scheduler.is_finished():
            raise ConfigError("the policy cannot change while a request runs: stop it or wait for the answer")
        policy = make_policy(name, params, self.config.mode)
        self.runner.set_policy(policy)
        self.block_manager.forget_cached()
        self.config.policy, self.config.policy_params = name, dict(params or {})
        if self.tier is not None and self.tier.fmt.model_id != kv_identity(self):
            self.tier.close()                  # sparse prefill KV is not dense KV: pages of another namespace
            self.tier = open_tier(self)

    def close(self) -> None:
        """Finish the disk tier's writes (the engine is usable no more for storing pages)."""
        if self.tier is not None:
            self.tier.close()

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    @recorder.setter
    def recorder(self, rec: Recorder | None) -> None:
        """Swap the recorder between requests (None = record nothing)."""
        self._recorder = self.runner.recorder = rec or NULL_RECORDER

    def _memory_metrics(self) -> dict:
        if self.device.type != "cuda":
            return {}
        allocated = torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]  # one C call
        return {"gpu_mem_allocated": allocated["current"], "gpu_mem_peak": allocated["peak"]}

    # ---------------------------------------------------------------- tokens
    def _eos_ids(self) -> set[int]:
        ids = set(self.args.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = self.model_dir / "generation_config.json" if self.model_dir else None
        if gen and gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError("this engine has random weights and no tokenizer: pass token ids, not text")
        return self.tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self._need_tokenizer().encode(text, add_special_tokens=False))

    def chat_prompt_ids(self, messages: list[dict] | str) -> list[int]:
        tok = self._need_tokenizer()
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not tok.chat_template:
            raise ModelError(f"{self.model_name} has no chat template: use generate() with plain text")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.kv_block_size

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        ids = prompt if isinstance(prompt, list) else self._need_tokenizer().encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        limit = min(self.max_model_len, self.kv_capacity_tokens)
        if len(ids) >= limit:
            if limit == self.max_model_len:
                why = f"the model's context is {self.max_model_len} tokens"
                fix = "shorten the document (or ask about a part of it)"
            elif self.config.mode != "gpu":
                why = f"the host KV pool holds {self.kv_capacity_tokens} tokens"
                fix = "raise host_kv_gb (--host-kv-gb)"
            else:
                why = f"the KV cache holds {self.kv_capacity_tokens} tokens"
                fix = "raise gpu_memory_utilization / cpu_kv_cache_gb or num_kv_blocks"
            raise ContextTooLongError(f"the prompt is {len(ids)} tokens but {why} (one more is needed for the "
                                      f"answer): {fix}", len(ids), limit)
        seq = Sequence(ids, params, self.config.kv_block_size)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        t0 = time.perf_counter()
        for s in seqs:
            if is_prefill and s.t_prefill_start is None:
                s.t_prefill_start = t0
        rec, tier = self._recorder, self.tier
        reads = []
        if tier is not None and is_prefill:      # pages on disk: read, not computed
            reads = [tier.fill(s) for s in seqs if not s.disk_checked]
            for s in seqs:
                s.disk_checked = True
        if rec.enabled:
            computed = sum(len(s) - s.num_cached_tokens for s in seqs) if is_prefill else len(seqs)
            rec.begin_step(PREFILL if is_prefill else DECODE, computed)
            for span in reads:
                if span is not None:
                    rec.add_span(span)
        task = self.runner.model.task
        if task is not None:
            task.prefill = is_prefill
        try:
            tokens = self.runner.run(seqs, is_prefill)
        except Cancelled:
            for s in seqs:
                if is_prefill:
                    self.block_manager.invalidate(s)
                self.cancel(s)
            raise
        except torch.OutOfMemoryError:
            for s in seqs:
                if is_prefill:
                    self.block_manager.invalidate(s)
            for s in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.finish(s, "cancelled")
            torch.cuda.empty_cache()
            knobs = ("max_num_batched_tokens, max_num_seqs or gpu_memory_utilization" if self.config.mode == "gpu" else
                     "prefill_chunk_tokens (--prefill-chunk), ring_slots (--ring-slots) or gpu_kv_budget_gb "
                     "(--gpu-kv-budget)")
            raise OutOfMemoryError("out of GPU memory during " + ("prefill" if is_prefill else "decode") +
                                   f" in {self.config.mode} mode: lower {knobs}") from None
        finally:
            if rec.enabled:  # on CUDA its events are read while the GPU runs the next step
                rec.end_step(self._step_metrics(seqs, is_prefill), defer=self.device.type == "cuda")
        if tier is not None:                     # full blocks not on disk yet: to the background writer
            for s in seqs:
                tier.write_back(s)
        self.scheduler.postprocess(seqs, tokens)
        for s in seqs:
            if s.is_finished:
                self.runner.sampler.forget(s.seq_id)
                if tier is not None:
                    tier.forget(s)
        if tier is not None:
            tier.poll()
        return seqs

    def _step_metrics(self, seqs: list[Sequence], is_prefill: bool) -> dict:
        m = {"batch": len(seqs), "context_tokens": sum(len(s) for s in seqs),
             "kv_blocks_used": self.block_manager.num_used, "kv_blocks_total": self.block_manager.num_blocks,
             "mem_kv_used": self.block_manager.num_used * self.runner.block_bytes}
        if self.config.mode != "gpu":
            m.update(self.runner.step_metrics())
        if is_prefill:
            m["prompt_tokens"] = sum(len(s) for s in seqs)
            m["cached_tokens"] = sum(s.num_cached_tokens for s in seqs)
            m["disk_cached_tokens"] = sum(s.disk_cached_tokens for s in seqs)
        else:
            m["decode_tokens"] = len(seqs)
        if self.tier is not None:
            m.update(self.tier.metrics())
        m.update(self._memory_metrics())
        return m

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "cancelled")
        self.runner.sampler.forget(seq.seq_id)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run several prompts together (batched in gpu mode); plain strings are used as is (no chat template)."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs: list[Sequence] = []
        try:
            for p, sp in zip(prompts, plist):
                seqs.append(self.add_request(p, sp))
        except Exception:  # one bad prompt: the ones already queued are withdrawn, nothing is left behind
            for s in seqs:
                self.cancel(s)
            raise
        while not all(s.is_finished for s in seqs):
            self.step()
        if self._recorder.enabled:
            self._recorder.flush()
        figures = self.runner.policy.stats()
        return [Completion(self._decode(s.completion_token_ids), s.completion_token_ids, _stats(s, figures))
                for s in seqs]

    def stream(self, messages: list[dict] | str, params: SamplingParams | None = None, cancel=None,
               progress: Progress | None = None) -> Iterator[StreamChunk]:
        """Chat: yield the answer as it is generated, then a final chunk with the stats.
        `cancel` is a threading.Event, checked after every layer (a long prefill stops within one layer's time);
        `progress(fraction, message)` hears how far the prefill got, layer by layer."""
        t_start = time.perf_counter()
        rec = self._recorder
        if rec.enabled:
            rec.begin_step(TOKENIZE)
        with rec.span(HOST, "chat template + tokenize"):
            ids = self.chat_prompt_ids(messages)
        if rec.enabled:
            rec.end_step({"prompt_tokens": len(ids)})
        seq = self.add_request(ids, params or SamplingParams())
        seq.t_arrival = t_start
        detok = _Detokenizer(self.tokenizer)
        seen = 0
        model = self.runner.model
        model.task = TaskState(cancel, progress) if cancel is not None or progress is not None else None
        try:
            while not seq.is_finished:
                if cancel is not None and cancel.is_set():
                    self.cancel(seq)
                    break
                try:
                    self.step()
                except Cancelled:
                    break
                new = seq.completion_token_ids[seen:]
                seen += len(new)
                text = "".join(detok.push(t) for t in new)
                if text:
                    yield StreamChunk(text)
        finally:
            model.task = None
            if not seq.is_finished:  # the consumer stopped early (closed generator): free the blocks
                self.cancel(seq)
            if rec.enabled:
                rec.flush()
        yield StreamChunk("", _stats(seq, self.runner.policy.stats()))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""


class _Detokenizer:
    """Incremental decoding that never emits half a multi-byte character."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def _stats(seq: Sequence, policy: dict) -> GenerationStats:
    end = seq.t_last_token or time.perf_counter()
    first = seq.t_first_token or end
    prefill_s = first - (seq.t_prefill_start or first)
    computed = seq.num_prompt_tokens - seq.num_cached_tokens
    decode_n = seq.num_completion_tokens - 1
    return GenerationStats(
        prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
        completion_tokens=seq.num_completion_tokens, ttft_s=first - seq.t_arrival,
        prefill_tok_s=computed / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decode_n / (end - first) if decode_n > 0 and end > first else 0.0,
        total_s=end - seq.t_arrival, finish_reason=seq.finish_reason or "cancelled",
        bytes_h2d=seq.bytes_h2d, bytes_d2h=seq.bytes_d2h, disk_cached_tokens=seq.disk_cached_tokens,
        policy_stats=policy)


def _make_runner(model, cfg: EngineConfig, device, dtype, max_model_len: int, rec: Recorder):
    if cfg.mode == "gpu":
        return ModelRunner(model, cfg, device, dtype, max_model_len, rec)
    from engine.offload import ChunkedRunner, LayerwiseRunner
    runner = (LayerwiseRunner if cfg.mode == "layerwise" else ChunkedRunner)(model, cfg, device, dtype, max_model_len, rec)
    plan = getattr(runner, "plan", None)
    if plan is not None:
        with rec.span(HOST, "residency plan", **plan.to_dict()):
            pass
    return runner


def check_model(model: str | None) -> None:
    """The cheap checks of a model folder (it exists, its config.json names a supported architecture), without
    loading anything: the app runs them before it lets go of the engine it has. Raises ModelError/ConfigError."""
    if model is not None:
        read_config(_resolve_model_dir(model, None))


def _resolve_model_dir(model: str | None, progress: Progress | None) -> Path:
    if model is None:
        from engine.defaults import ensure_default_model
        return ensure_default_model(progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}; --model takes a Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files), or leave it out for the default model")
    return path


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ModelError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {str(e)[:200]}); the folder needs "
                         "tokenizer.json or tokenizer.model with tokenizer_config.json") from None
    tok.model_max_length = 1 << 40  # the engine checks lengths itself, against the real limits, with better words
    return tok
