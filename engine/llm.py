"""LLM: load a model, then generate, stream and count tokens. The one entry point of the engine."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.control import TaskState
from engine.errors import Cancelled, ConfigError, ContextTooLongError, ModelError, OutOfMemoryError
from engine import host_malloc
from engine.offload.tier import model_identity, open_tier
from engine.outputs import Completion, Detokenizer, StreamChunk, request_stats, token_ends
from engine.model_folder import eos_ids, load_tokenizer, resolve_model_dir
from engine.models.loader import build_model, load_weights, random_weights
from engine.models.registry import parse_config, read_config
from engine.sampling import SamplingParams
from engine.runner import Runner, make_runner
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.sparse import make_policy
from engine.step import StepContext
from engine.trace.events import DECODE, HOST, LOAD, PREFILL, TOKENIZE
from engine.trace.recorder import NULL_RECORDER, Recorder

Progress = Callable[[float, str], None]


class LLM:
    """The engine. A context manager: `with LLM(...) as llm:` closes it (threads joined, memory unpinned)."""

    def __init__(self, model: str | None = None, progress: Progress | None = None,
                 recorder: Recorder | None = None, **config):
        self.config = EngineConfig.from_kwargs(model=model, **config)
        cfg = self.config
        policy = make_policy(cfg.policy, cfg.policy_params, cfg.mode)   # a bad policy fails before any loading
        self.runner: Runner | None = None
        self.tier = None
        self._task: TaskState | None = None    # the running request's cancel flag and progress
        self._steps = 0
        rec = self._recorder = recorder or NULL_RECORDER
        if rec.enabled:
            rec.begin_step(LOAD)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = cfg.resolve_device()
        if self.device.type == "cpu":
            host_malloc.tune()                 # big tensors reused, not mapped afresh (engine/host_malloc.py)
        self.dtype = cfg.resolve_dtype(self.device)
        self.tokenizer = None
        if cfg.shape is not None:
            shape = cfg.shape.get("_name", cfg.shape.get("model_type", "?"))
            self.model_dir, self.model_name = None, f"random weights, {shape} shape"
            args = parse_config(cfg.shape, f"shape {shape}")
        else:
            self.model_dir = resolve_model_dir(cfg.model, progress)
            self.model_name = self.model_dir.name
            args = read_config(self.model_dir)
            self.tokenizer = load_tokenizer(self.model_dir)
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
            self.runner = make_runner(model, cfg, self.device, self.dtype, self.max_model_len, policy, rec)
            del model        # the runner holds it (a frame that outlives this call must not: see close())
        except torch.OutOfMemoryError:
            raise OutOfMemoryError(f"{self.model_name} does not fit in {self.device} memory in "
                                   f"{str(self.dtype).removeprefix('torch.')}: use a smaller model or --device cpu") from None
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.kv_block_size)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, self.runner.max_num_batched_tokens,
                                   eos_ids(self.args.eos_token_ids, self.tokenizer, self.model_dir), self.max_model_len)
        self.tier = self._open_tier()           # the disk KV tier (config.kv_store), or None
        self.plan = self.runner.plan            # layerwise: which layers stay on the device
        if self.plan is not None:
            with rec.span(HOST, "residency plan", **self.plan.to_dict()):
                pass
        if rec.enabled:
            rec.end_step(self._memory_metrics())
        if progress:
            if self.plan is not None:
                progress(1.0, self.plan.describe())
            progress(1.0, "ready")

    def set_policy(self, name: str, params: dict | None = None) -> None:
        """Switch the sparse policy between requests. Where both prefill densely, the prefix cache keeps the blocks
        whose KV a dense prefill computes (not those a sparse decode wrote to) and the new policy is shown their keys
        (Quest's page index); otherwise it is dropped, so the next prompt really runs the new policy."""
        if not self.scheduler.is_finished():
            raise ConfigError("the policy cannot change while a request runs: stop it or wait for the answer")
        old, policy = self.runner.policy, make_policy(name, params, self.config.mode)
        self.runner.set_policy(policy)
        self.block_manager.forget_cached(inexact_only=not (old.supports_prefill or policy.supports_prefill))
        self.runner.written(self.block_manager.cached_ids())
        self.config.policy, self.config.policy_params = name, dict(params or {})
        if self.tier is not None and self.tier.fmt.model_id != self._kv_identity():
            self.tier.close()                  # sparse prefill KV is not dense KV: pages of another namespace
            self.tier = self._open_tier()

    def _kv_identity(self) -> str:
        """The disk tier's namespace: what determines the KV (the model, and the policy where it changes prefill KV)."""
        cfg = self.config
        name = "" if self.model_dir is not None else f"random weights {json.dumps(cfg.shape, sort_keys=True)}, seed {cfg.seed}"
        return model_identity(self.model_dir, name, cfg.policy, cfg.policy_params, self.runner.policy.supports_prefill)

    def _open_tier(self):
        cfg, a = self.config, self.args
        if not cfg.kv_store:
            return None
        layout = (a.num_layers, 2, a.num_kv_heads, cfg.kv_block_size, a.head_dim)
        return open_tier(cfg.kv_store, cfg.kv_store_gb, self._kv_identity(), str(self.dtype).removeprefix("torch."),
                         layout, self.runner, self.block_manager)

    def close(self) -> None:
        """Finish the disk tier's writes, then close the runner: every copy and writer thread is joined and the
        pinned host memory freed. The engine cannot run after this. Idempotent."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self.runner is not None:
            self.runner.close()
            # its model and KV go now, by reference count: the tokenizer's loading leaves a frame of this object's
            # __init__ alive in a reference cycle, which only a garbage collection would break
            self.runner = None

    def warm_up(self, progress: Progress | None = None) -> None:
        """CUDA: compile and capture now what a user's first request would, so it runs at the pace of later ones:
        two throwaway prompts of different lengths (compiled functions specialise on the first shape and turn
        dynamic on the second), a few decode steps each (every layer's CUDA graph in each ring buffer), the second
        traced (gpu mode's traced graphs), both at least as long as the policy needs to run sparse
        (`warm_up_tokens`, where the context holds it). Their KV leaves the prefix cache (what was cached before
        stays) and the disk tier never sees it; nothing is recorded. Nothing to do on CPU. `progress` hears that it
        runs. Run it again after `set_policy` (the app does): a new policy's kernels and graphs are made then."""
        if self.device.type != "cuda":
            return
        if progress:
            progress(1.0, "warming up: compiling kernels, capturing CUDA graphs")
        from engine.ops.attention import warm_up_prefill
        from engine.trace.recorder import TraceRecorder
        a = self.args
        warm_up_prefill(a.num_heads, a.num_kv_heads, a.head_dim, self.dtype, self.device)
        tier, saved, self.tier = self.tier, self._recorder, None
        kept = dict(self.block_manager.hash_to_block)    # the user's cached prompts (kept by a policy switch)
        steps = self.config.ring_slots + 2
        room = min(self.max_model_len, self.kv_capacity_tokens) - steps - 1
        try:
            for i, rec in enumerate((NULL_RECORDER, TraceRecorder(max_steps=16, device=self.device, nvtx=False))):
                n = max((2 + i) * self.config.kv_block_size, self.runner.policy.warm_up_tokens()) + 7 * (i + 1)
                n = max(1, min(n, room))
                self._recorder = rec
                self.generate([[(101 + 37 * j + i) % self.args.vocab_size for j in range(n)]],
                              SamplingParams(max_tokens=steps, ignore_eos=True))
                self.block_manager.forget_cached(keep=kept)   # its blocks clean: the next prompt takes them first
        finally:
            self._recorder, self.tier = saved, tier
            self.block_manager.forget_cached(keep=kept)
            self.runner.policy.forget()          # (Quest's sketch basis: from the user's prompt, not these)
            self.runner.written(self.block_manager.cached_ids())   # ... or from the cached ones it keeps

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    @recorder.setter
    def recorder(self, rec: Recorder | None) -> None:
        """Swap the recorder between requests (None = record nothing); each step reports to it."""
        self._recorder = rec or NULL_RECORDER

    def _memory_metrics(self) -> dict:
        if self.device.type != "cuda":
            return {}
        allocated = torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]  # one C call
        return {"gpu_mem_allocated": allocated["current"], "gpu_mem_peak": allocated["peak"]}

    # ---------------------------------------------------------------- tokens
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError("this engine has no tokenizer (random weights, or a model folder without tokenizer.json "
                              "or tokenizer.model): pass token ids, not text, or add the tokenizer files")
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

    def tokenize_turn(self, messages: list[dict] | str) -> list[int]:
        """`chat_prompt_ids`, recorded as a step of its own (a turn's first)."""
        rec = self._recorder
        if rec.enabled:
            rec.begin_step(TOKENIZE)
        with rec.span(HOST, "chat template + tokenize"):
            ids = self.chat_prompt_ids(messages)
        if rec.enabled:
            rec.end_step({"prompt_tokens": len(ids)})
        return ids

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
            reads = [tier.fill(s, rec) for s in seqs if not s.disk_checked]
            for s in seqs:
                s.disk_checked = True
        if rec.enabled:
            computed = sum(len(s) - s.num_cached_tokens for s in seqs) if is_prefill else len(seqs)
            rec.begin_step(PREFILL if is_prefill else DECODE, computed,   # (a step issued ahead ran untimed)
                           timeline=not self.runner.issued_for(seqs, is_prefill))
            for span in reads:
                if span is not None:
                    rec.add_span(span)
        ctx = StepContext(self._steps, is_prefill, rec, self._task)
        self._steps += 1
        try:
            tokens = self.runner.run(seqs, is_prefill, ctx)
            if not is_prefill and self.runner.policy.plans_loads:   # attention over a subset: not a prefill's KV
                self.block_manager.mark_inexact(seqs)
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
            else:
                self.runner.step_metrics()       # the policy's per-step figures are read (and reset) every step
        if tier is not None:                     # full blocks not on disk yet: to the background writer
            for s in seqs:
                tier.write_back(s)
        self.scheduler.postprocess(seqs, tokens)
        for s in seqs:
            if s.params.leads:
                s.leads.append(self.runner.sampler.leads[s.seq_id])
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
        m.update(self.runner.step_metrics())
        if is_prefill:
            m["prompt_tokens"] = sum(len(s) for s in seqs)
            m["cached_tokens"] = sum(s.num_cached_tokens for s in seqs)
            m["disk_cached_tokens"] = sum(s.disk_cached_tokens for s in seqs)
        else:
            m["decode_tokens"] = len(seqs)
        if self.tier is not None:
            m.update(self.tier.metrics())
        if self._recorder.detail:             # the allocator's stats are a dict of ~100 entries: not every step
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
        out = [Completion(self._decode(s.completion_token_ids), s.completion_token_ids, request_stats(s, figures),
                          s.leads) for s in seqs]
        for c in out:
            c.stats.token_ends = token_ends(self.tokenizer, c.token_ids)
        return out

    def stream(self, messages: list[dict] | str, params: SamplingParams | None = None, cancel=None,
               progress: Progress | None = None, prompt_ids: list[int] | None = None) -> Iterator[StreamChunk]:
        """Chat: yield the answer as it is generated, then a final chunk with the stats.
        `cancel` is a threading.Event, checked after every layer (a long prefill stops within one layer's time);
        `progress(fraction, message)` hears how far the prefill got, layer by layer. `prompt_ids`: the messages'
        `tokenize_turn`, where the caller made them already (a long document is not tokenized twice)."""
        t_start = time.perf_counter()
        rec = self._recorder
        ids = self.tokenize_turn(messages) if prompt_ids is None else prompt_ids
        seq = self.add_request(ids, params or SamplingParams())
        seq.t_arrival = t_start
        detok = Detokenizer(self.tokenizer)
        seen, ends = 0, []                   # ends: the answer's length after each token (where two answers part)
        self._task = TaskState(cancel, progress) if cancel is not None or progress is not None else None
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
                pieces = [detok.push(t) for t in new]
                for piece in pieces:
                    ends.append((ends[-1] if ends else 0) + len(piece))
                if any(pieces):
                    yield StreamChunk("".join(pieces))
        finally:
            self._task = None
            if not seq.is_finished:  # the consumer stopped early (closed generator): free the blocks
                self.cancel(seq)
            if rec.enabled:
                rec.flush()
        stats = request_stats(seq, self.runner.policy.stats())
        stats.token_ends = ends
        yield StreamChunk("", stats)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

