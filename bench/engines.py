"""The engines `python -m bench` times side by side, each with the same small interface: `name`,
`prefill_s(n)` (seconds to the first token of an n-token prompt), `decode_s_per_token(ctx, steps)` and `close()`.

Ours (the engine in one mode and policy; `variant()` runs another policy on the same engine), OursTraced (with a
recording TraceRecorder on), Transformers (the same model or shape in transformers, sdpa) and
TransformersOffloaded (its offloaded KV cache).
"""
from __future__ import annotations

import copy
import time

import torch

from app.heap import freeze
from bench.shapes import shape_config
from engine import LLM, SamplingParams
from engine.step import StepContext


def _text_ids(llm, text: str) -> list[int]:
    """Token ids of a text file ("sample": the bundled sample document): real text gives real attention."""
    from app.samples import SAMPLE
    path = SAMPLE if text == "sample" else text
    with open(path, encoding="utf-8") as f:
        return llm.tokenizer.encode(f.read())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


class Ours:
    def __init__(self, args, max_len: int, mode: str = "gpu", policy: str = "full", params: dict | None = None):
        """The engine is built with `policy` (a layerwise plan keeps Quest's dense layers resident first)."""
        self.name = "kvscope" if mode == "gpu" else mode
        self.mode = mode
        kw = {"ring_slots": args.ring_slots, "gpu_kv_budget_gb": args.gpu_kv_budget} if mode != "gpu" else {}
        block = args.chunked_block if mode == "chunked" else 256
        if mode == "gpu":  # room for one sequence only, so that other engines fit beside it
            kw["num_kv_blocks"] = -(-max_len // block) + 1
        mem0 = _allocated()
        shape = shape_config(args.shape) if args.shape is not None else None
        self.llm = LLM(args.model, shape=shape, device=args.device, dtype=args.dtype, max_num_seqs=1,
                       max_model_len=max_len, enforce_eager=args.eager, mode=mode, kv_block_size=block,
                       policy=policy, policy_params=params or {}, **kw)
        self.static_bytes = _allocated() - mem0   # weights + KV buffers
        self.peak_bytes = 0
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = self.llm.args.vocab_size
        self.text_ids = _text_ids(self.llm, args.text) if getattr(args, "text", None) else None
        self.freeze = not getattr(args, "no_freeze", False)
        self.switch_s: list[float] = []      # each switch's set_policy + warm-up (the base engine's, shared)
        self.base, self.policy, self.params = self.name, "full", {}
        if policy != "full":
            self.name, self.policy, self.params = _label(self.name, policy, params), policy, params or {}

    def variant(self, policy: str, params: dict) -> "Ours":
        """The same engine running another policy (switched before each of its runs)."""
        v = copy.copy(self)
        v.name, v.policy, v.params = self.base if policy == "full" else _label(self.base, policy, params), policy, params
        return v

    def _use(self, **extra) -> None:
        """Switch the engine to this variant's policy as the app does: set_policy, then warm_up (a switch drops the
        graphs that ran the old policy's work; without it the first answer's first steps capture them anew:
        50-135 ms each for six steps at 128K on an H200), then the new objects out of full collections. A run with
        `extra` parameters (Quest's recall) times nothing: no warm-up for it."""
        want = (self.policy, {**self.params, **extra})
        if (self.llm.config.policy, self.llm.config.policy_params) != want:
            t = time.perf_counter()
            self.llm.set_policy(*want)
            if extra:
                return
            self.llm.warm_up()
            if self.freeze:
                freeze()
            self.switch_s.append(time.perf_counter() - t)

    def _prompt(self, n: int) -> list[int]:
        """n random token ids, or n tokens of the text from a random place (the text repeated as needed)."""
        if self.text_ids is None:
            return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()
        ids = self.text_ids * (1 + n // len(self.text_ids))
        start = int(torch.randint(0, len(ids) - n + 1, (1,), generator=self.gen))
        return ids[start:start + n]

    def _run(self, n: int, new: int, **policy_extra):
        self._use(**policy_extra)
        base = _allocated()
        if self.llm.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        llm, step, self.step_ms = self.llm, self.llm.step, []

        def timed_step():            # each decode step's wall time: is a mean made by a few slow steps?
            decode = all(s.num_completion_tokens for s in llm.scheduler.running) and not llm.scheduler.waiting
            t = time.perf_counter()
            step()
            if decode:
                self.step_ms.append((time.perf_counter() - t) * 1e3)
        llm.step = timed_step
        try:
            out = llm.generate([self._prompt(n)], SamplingParams(max_tokens=new, ignore_eos=True))[0]
        finally:
            del llm.step
        if self.llm.device.type == "cuda":
            self.peak_bytes = max(self.peak_bytes, self.static_bytes + torch.cuda.max_memory_allocated() - base)
        self.last = out.stats
        return out.stats

    def prefill_s(self, n: int) -> float:
        return self._run(n, 1).ttft_s

    def decode_s_per_token(self, ctx: int, steps: int) -> float:
        return 1.0 / self._run(ctx, steps + 1).decode_tok_s

    def decode_trace(self, ctx: int, steps: int) -> dict:
        """One traced decode: H2D GB/s, compute busy fraction and exposed copy time over its steady steps."""
        from engine.trace import TraceRecorder, summarize
        rec = TraceRecorder(max_steps=steps + 8, device=self.llm.device, nvtx=False)
        self.llm.recorder = rec
        try:
            self._run(ctx, steps + 1)
        finally:
            self.llm.recorder = None
        every = [s for s in rec.steps if s.phase == "decode"]      # (the recorder holds them all: max_steps)
        decodes = every[2:]
        sm = summarize(decodes)
        step_h2d = [float(s.metrics.get("bytes_h2d", 0.0)) for s in every]
        return {"h2d_gbps": sm.gbps.get("h2d", 0.0), "compute_busy": sm.busy_fraction.get("compute", 0.0),
                "prefill_h2d_gb": (self.last.bytes_h2d - sum(step_h2d)) / 1e9,     # this run's, less its decode's
                "decode_h2d_gb_per_token": sum(step_h2d) / max(1, len(step_h2d)) / 1e9,
                "exposed_copy_ms_per_token": sm.exposed_copy_us / 1e3 / max(1, len(decodes)),
                "ms_per_token_traced": (decodes[-1].t1_us - decodes[0].t0_us) / 1e3 / max(1, len(decodes)),
                "first_steps_ms": [round(s.dur_us / 1e3, 1) for s in rec.steps if s.phase == "decode"][:3]}

    def decode_graph_s(self, ctx: int, replays: int = 20) -> float:
        """GPU time of one decode step alone (graph replay at a `ctx` context), without the host work around it."""
        llm = self.llm
        seq = llm.add_request(self._prompt(ctx), SamplingParams(max_tokens=2, ignore_eos=True))
        llm.step()  # prefill
        llm.scheduler.schedule()  # decode step planned: inputs for the graph
        llm.runner.forward_logits([seq], False, StepContext())  # fills the graph's inputs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            llm.runner.graphs[min(llm.runner.graphs)].replay()
        end.record()
        end.synchronize()
        llm.cancel(seq)
        return start.elapsed_time(end) / 1e3 / replays

    @property
    def device(self):
        return self.llm.device

    def close(self):
        close = getattr(self.llm.runner, "close", None)  # offload runners stop their copy streams
        if close is not None:
            close()
        del self.llm


class OursTraced:
    """The same engine (and policy) with a recording recorder on, as the app records (a decode step's per-layer
    timeline at the views' redraw rate, LIVE_DETAIL_HZ): the overhead of watching, measured side by side."""

    def __init__(self, ours: Ours):
        from engine.trace import TraceRecorder
        self.ours, self.recorder = ours, TraceRecorder.live(ours.llm.device, max_steps=256, mode=ours.llm.config.mode)
        self.name = f"{ours.name}+trace"

    def _traced(self, fn, *args):
        self.ours.llm.recorder = self.recorder
        try:
            return fn(*args)
        finally:
            self.ours.llm.recorder = None

    @property
    def step_ms(self) -> list[float]:
        return self.ours.step_ms

    def prefill_s(self, n: int) -> float:
        return self._traced(self.ours.prefill_s, n)

    def decode_s_per_token(self, ctx: int, steps: int) -> float:
        return self._traced(self.ours.decode_s_per_token, ctx, steps)

    def close(self):
        pass


class _TokenTimes:
    """A transformers streamer that only notes when each token arrives (after the device has produced it)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value):
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


class Transformers:
    name = "transformers"
    cache = None

    def __init__(self, args, ours: Ours):
        import transformers as tf
        self.device, dtype = ours.llm.device, ours.llm.dtype
        if args.shape is not None:
            cfg = tf.AutoConfig.for_model(**{k: v for k, v in shape_config(args.shape).items()
                                             if k not in ("torch_dtype", "_name")})
        else:
            cfg = tf.AutoConfig.from_pretrained(str(ours.llm.model_dir), local_files_only=True)
        cfg._attn_implementation = "sdpa"
        with torch.device(self.device):
            self.model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        if args.shape is None:  # same weights as ours
            from safetensors.torch import load_file
            state = {}
            for f in sorted(ours.llm.model_dir.glob("*.safetensors")):
                state.update(load_file(str(f)))
            self.model.load_state_dict(state, strict=False)
            self.model.tie_weights()
        self.vocab = cfg.vocab_size
        self.gen = torch.Generator().manual_seed(1)

    def _generate(self, n: int, new: int) -> tuple[float, list[float]]:
        """-> (seconds for the whole call, host times at which each answer token came out)."""
        ids = torch.randint(0, self.vocab, (1, n), generator=self.gen).to(self.device)
        stamps = _TokenTimes(self.device)
        _sync(self.device)
        t = time.perf_counter()
        with torch.inference_mode():
            kw = {"cache_implementation": self.cache} if self.cache else {}
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0, streamer=stamps, **kw)
        _sync(self.device)
        return time.perf_counter() - t, stamps.times[1:]  # the first put() is the prompt

    def prefill_s(self, n: int) -> float:
        return self._generate(n, 1)[0]

    def decode_s_per_token(self, ctx: int, steps: int) -> float:
        """First answer token to last, like ours (not a difference of two runs, which prefill noise swamps)."""
        times = self._generate(ctx, steps + 1)[1]
        return (times[-1] - times[0]) / (len(times) - 1)

    def close(self):
        del self.model


class TransformersOffloaded(Transformers):
    """transformers with `cache_implementation="offloaded"` (KV on the host, layer by layer); the same model."""
    name = "hf-offloaded"
    cache = "offloaded"

    def __init__(self, hf: Transformers, max_steps: int):
        self.model, self.vocab, self.device, self.gen, self.max_steps = hf.model, hf.vocab, hf.device, hf.gen, max_steps

    def decode_s_per_token(self, ctx: int, steps: int) -> float:
        return super().decode_s_per_token(ctx, min(steps, self.max_steps))

    def close(self):
        pass


def _label(base: str, policy: str, params: dict | None) -> str:
    """A column name: mode+policy, with the parameters when given (two budgets of one policy differ; so do two
    policies whose values are the same but whose keys are not)."""
    return f"{base}+{policy}" + (f"({','.join(f'{k}={v}' for k, v in params.items())})" if params else "")
