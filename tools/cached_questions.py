"""Questions about one cached document, each of a new length: the prefill step (time to first token) of each.

    python tools/cached_questions.py --mode layerwise                  (the default model's shape, random weights)
    python tools/cached_questions.py --model PATH --mode gpu --doc-tokens 20000
    python tools/cached_questions.py --mode gpu --fresh                (a new document each time: whole prompts)

One engine, warmed up as the command line and the app warm it, then one request per question length: the document's
tokens (block-aligned, so later questions find them in the prefix cache), then the question's. The first also
prefills the document. A kernel that compiles or plans per shape shows as a slow later question: before attention
over a cached prefix ran as a lower-right CausalBias, cuDNN built a graph per new length (0.16-1.02 s each on an
H100, see docs/gpu-app.md). `--fresh`: every request a new document, so each is a whole prompt of a new length (the
first question about a document; cuDNN built a graph for each, ~45 ms on an H100, before such a length ran flash).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import shape_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: --shape with random weights)")
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--mode", default="layerwise")
    p.add_argument("--doc-tokens", type=int, default=5632)
    p.add_argument("--lengths", default="222,229,236,285,300,222", help="the questions' lengths in tokens")
    p.add_argument("--fresh", action="store_true", help="a new document for every question (nothing cached)")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    llm = LLM(a.model, shape=None if a.model else shape_config(a.shape), mode=a.mode, max_num_seqs=1,
              max_model_len=a.doc_tokens + max(lengths) + 64)
    llm.warm_up()
    bs = llm.config.kv_block_size
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(0, llm.args.vocab_size, (a.doc_tokens // bs * bs,), generator=gen).tolist()
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    times = []
    for n in lengths:
        if a.fresh:
            doc = torch.randint(0, llm.args.vocab_size, (len(doc),), generator=gen).tolist()
        seq = llm.add_request(doc + torch.randint(0, llm.args.vocab_size, (n,), generator=gen).tolist(),
                              SamplingParams(max_tokens=4, ignore_eos=True))
        sync()
        t0 = time.perf_counter()
        llm.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        while not seq.is_finished:
            llm.step()
    what = "a new document each time" if a.fresh else "the first also the document's"
    print(f"{llm.device} {a.mode}, a {len(doc):,}-token document: the prefill of each question "
          f"({', '.join(map(str, lengths))} tokens; {what}), ms: "
          + " ".join(f"{t:.1f}" for t in times))


if __name__ == "__main__":
    main()
