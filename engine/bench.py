"""Benchmarks: ours vs transformers, side by side in one run, medians of repeats.

    python -m engine.bench                                  # CPU, default model: prefill 2K/6K, decode
    python -m engine.bench --shape qwen3-4b --lengths 32768 # GPU, random weights of Qwen3-4B's shape, bf16

Prompts are random token ids, fresh per repeat (so the prefix cache never helps). Decode is timed from the
first answer token to the last, at a context of the prompt length. Absolute times only mean something on a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from engine import LLM, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Ours:
    name = "kvscope"

    def __init__(self, args, max_len: int):
        self.llm = LLM(args.model, shape=args.shape, device=args.device, dtype=args.dtype, max_num_seqs=1,
                       max_model_len=max_len, enforce_eager=args.eager)
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = self.llm.args.vocab_size

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def prefill_s(self, n: int) -> float:
        out = self.llm.generate([self._prompt(n)], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        return out.stats.ttft_s

    def decode_s_per_token(self, ctx: int, steps: int) -> float:
        out = self.llm.generate([self._prompt(ctx)], SamplingParams(max_tokens=steps + 1, ignore_eos=True))[0]
        return 1.0 / out.stats.decode_tok_s

    def decode_graph_s(self, ctx: int, replays: int = 20) -> float:
        """GPU time of one decode step alone (graph replay at a `ctx` context), without the host work around it."""
        llm = self.llm
        seq = llm.add_request(self._prompt(ctx), SamplingParams(max_tokens=2, ignore_eos=True))
        llm.step()  # prefill
        llm.scheduler.schedule()  # decode step planned: inputs for the graph
        llm.runner._decode_logits([seq])
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
        del self.llm


class OursTraced:
    """The same engine with a recording recorder on: the overhead of tracing, measured side by side."""
    name = "kvscope+trace"

    def __init__(self, ours: Ours):
        from engine.trace import TraceRecorder
        self.ours, self.recorder = ours, TraceRecorder(max_steps=256, device=ours.llm.device)

    def _traced(self, fn, *args):
        self.ours.llm.recorder = self.recorder
        try:
            return fn(*args)
        finally:
            self.ours.llm.recorder = None

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

    def __init__(self, args, ours: Ours):
        import transformers as tf
        self.device, dtype = ours.llm.device, ours.llm.dtype
        if args.shape is not None:
            from engine.models.registry import shape_config
            cfg = tf.AutoConfig.for_model(**{k: v for k, v in shape_config(args.shape).items() if k != "torch_dtype"})
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
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0, streamer=stamps)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--shape", default=None, help="random weights of a real model's shape, e.g. qwen3-4b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--lengths", default=None, help="prompt lengths, comma separated (default 2048,6144 on CPU, "
                   "32768 on GPU)")
    p.add_argument("--decode-steps", type=int, default=None, help="tokens timed per decode run (default 32 CPU, 64 GPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--trace", action="store_true", help="also run ours with a recording recorder (tracing overhead)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    lengths = [int(x) for x in (args.lengths or ("32768" if on_gpu else "2048,6144")).split(",")]
    steps = args.decode_steps or (64 if on_gpu else 32)
    max_len = max(lengths) + steps + 16

    ours = Ours(args, max_len)
    engines = [ours] + ([OursTraced(ours)] if args.trace else [])
    if not args.no_transformers:
        engines.append(Transformers(args, ours))
    n = max(lengths)
    measures = [(f"prefill {m} (tok/s)", lambda e, m=m: m / e.prefill_s(m)) for m in lengths]
    measures.append((f"decode @{n} (ms/token)", lambda e: 1e3 * e.decode_s_per_token(n, steps)))
    if ours.llm.runner.graphs:
        measures.append(("  GPU only, graph replay (ms)", lambda e: 1e3 * e.decode_graph_s(n) if e is ours else None))
    rows: dict[str, dict[str, float]] = {}
    for what, fn in measures:  # engines alternate within each repeat, so drift hits both alike
        print(f"# {what}", file=sys.stderr, flush=True)
        samples: dict[str, list[float]] = {e.name: [] for e in engines}
        for e in engines:
            fn(e)  # warm-up
        for _ in range(args.repeats):
            for e in engines:
                value = fn(e)
                if value is not None:
                    samples[e.name].append(value)
        rows[what] = {name: statistics.median(v) for name, v in samples.items() if v}
    desc = (f"{ours.llm.model_name} · {ours.llm.device} · {str(ours.llm.dtype).removeprefix('torch.')} · "
            f"torch {torch.__version__} · graphs {'on' if ours.llm.runner.graphs else 'off'}")
    for e in engines:
        e.close()
    gc.collect()

    print(f"\n{desc}\nmedian of {args.repeats} runs after a warm-up, engines alternating; decode timed over {steps} tokens\n")
    names = [e.name for e in engines]
    print(f"{'':28}" + "".join(f"{n:>16}" for n in names))
    for what, vals in rows.items():
        line = f"{what:28}" + "".join(f"{vals.get(n, float('nan')):>16,.2f}" for n in names)
        if "transformers" in vals:
            ratio = vals["kvscope"] / vals["transformers"]
            better = ratio if "tok/s" in what else 1 / ratio
            line += f"   vs transformers {better:.2f}x {'faster' if better >= 1 else 'slower'}"
        if "kvscope+trace" in vals:
            cost = vals["kvscope"] / vals["kvscope+trace"] if "tok/s" in what else vals["kvscope+trace"] / vals["kvscope"]
            line += f"   tracing costs {100 * (cost - 1):+.1f}%"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": desc, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
