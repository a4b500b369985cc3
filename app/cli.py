"""Headless command line: `python main.py chat --document FILE --ask "..."` streams the answer.

`kvscope` / `python main.py` with no arguments opens the desktop app (app/gui.py); `python main.py chat` with no
options runs the chat on the bundled sample document and its sample question.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent.parent / "resources" / "samples" / "kv_cache_offload_primer.md"
SAMPLE_QUESTION = ("What is the name of the Halvorsen lab's profiling dashboard that shows busy fraction, overlap and "
                   "exposed copy time per layer?")  # the answer sits near the end of the ~5.8K-token sample


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscope", description="Chat with a long document on kvscope's engine.")
    sub = p.add_subparsers(dest="command")
    c = sub.add_parser("chat", help="ask one question about a document, stream the answer")
    c.add_argument("--document", "-d", type=Path, default=None, help="text, markdown, PDF or HTML file "
                   "(default: the bundled sample)")
    c.add_argument("--ask", "-q", default=None, help="the question (default: a question about the sample)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--model", "-m", default=None, help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    c.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    c.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    c.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    c.add_argument("--mode", choices=("gpu", "layerwise", "chunked"), default="gpu",
                   help="where KV lives: gpu (paged, on the device), layerwise (host pool, a ring of whole-layer device "
                   "buffers), chunked (host pool, block-sized chunks through a ring of block slots)")
    c.add_argument("--ring-slots", type=int, default=3, help="offload modes: device buffers in the ring")
    c.add_argument("--gpu-kv-budget", type=float, default=None, metavar="GB",
                   help="layerwise: device memory for KV; layers that fit stay resident, the rest stream")
    c.add_argument("--host-kv-gb", type=float, default=None, metavar="GB",
                   help="offload modes: host KV pool (default: one sequence of --max-model-len)")
    c.add_argument("--prefill-chunk", type=int, default=8192, metavar="TOKENS",
                   help="layerwise prefill: rows per QKV/MLP chunk (bounds activation memory)")
    c.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    c.add_argument("--policy", choices=("full", "quest", "minference", "xattention"), default="full",
                   help="sparse attention policy: full (dense); quest (decode loads only the top KV pages; layerwise); "
                   "minference (prefill on vertical-slash patterns) or xattention (prefill on blocks chosen by "
                   "antidiagonal scores), both gpu or layerwise")
    c.add_argument("--quest-budget", type=int, default=2048, help="quest: tokens of KV loaded per layer and kv head")
    c.add_argument("--quest-page", type=int, default=32, help="quest: page size in tokens (divides --block-size)")
    c.add_argument("--quest-dense-layers", type=int, default=2, help="quest: first layers kept dense")
    c.add_argument("--quest-recall", action="store_true",
                   help="quest: measure recall (attention mass on the loaded pages) from the whole K each step (slow)")
    c.add_argument("--minference-vertical", type=float, default=1000,
                   help="minference: vertical columns per head (a count, or a fraction of the prompt if <= 1)")
    c.add_argument("--minference-slash", type=float, default=6096,
                   help="minference: slash diagonals per head (a count, or a fraction of the prompt if <= 1)")
    c.add_argument("--xattention-threshold", type=float, default=0.9,
                   help="xattention: keep key blocks until their estimated share of attention reaches this")
    c.add_argument("--xattention-stride", type=int, default=16, help="xattention: antidiagonal stride")
    c.add_argument("--sparse-min-len", type=int, default=8192,
                   help="minference/xattention: prompts shorter than this (tokens) run dense")
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--kv-store", default="default", metavar="DIR",
                   help="disk KV tier: full KV pages of documents read before are kept here and read back instead "
                   "of computing their prefill again (default: kvscope/kv in the user cache folder)")
    c.add_argument("--no-kv-store", action="store_true", help="neither read nor write KV pages on disk")
    c.add_argument("--kv-store-gb", type=float, default=20.0, help="the disk KV tier's size limit (LRU)")
    c.add_argument("--json", action="store_true", help="print one JSON object at the end (answer + stats)")
    c.add_argument("--trace", type=Path, default=None, help="write what the engine did as a Chrome trace-event "
                   "JSON for Perfetto / chrome://tracing (.json or .json.gz)")
    k = sub.add_parser("kv-store", help="show or clear the disk KV tier")
    k.add_argument("action", choices=("show", "clear"))
    k.add_argument("--dir", default=None, help="the store's folder (default: kvscope/kv in the user cache folder)")
    return p


def kv_store_command(args) -> int:
    """`kv-store show`: pages and bytes per model namespace; `kv-store clear`: delete every page."""
    from engine.offload.storage import KVStore, PageFormat, default_store_dir
    root = Path(args.dir) if args.dir else default_store_dir()
    if not root.is_dir():
        print(f"{root}: no KV pages stored yet")
        return 0
    store = KVStore(root, PageFormat("-", "float32", (1, 2, 1, 1, 1)), 1 << 62)   # any format sees the whole store
    if args.action == "clear":
        print(f"{root}: deleted {store.clear() / 2**20:,.1f} MiB of KV pages")
        return 0
    pages, nbytes = store.usage()
    print(f"{root}: {pages} pages, {nbytes / 2**20:,.1f} MiB")
    for row in store.summary():
        print(f"  model/format {row['namespace']}: {row['pages']} pages, {row['bytes'] / 2**20:,.1f} MiB")
    return 0


def policy_params(args) -> dict:
    """The chosen policy's parameters from the command line."""
    return {"full": {},
            "quest": {"token_budget": args.quest_budget, "page_size": args.quest_page,
                      "dense_layers": args.quest_dense_layers, "recall": args.quest_recall},
            "minference": {"vertical": args.minference_vertical, "slash": args.minference_slash,
                           "min_len": args.sparse_min_len},
            "xattention": {"threshold": args.xattention_threshold, "stride": args.xattention_stride,
                           "min_len": args.sparse_min_len}}[args.policy]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        from app.gui import run
        return run(sys.argv[:1])
    args = build_parser().parse_args(argv)
    if args.command == "kv-store":
        return kv_store_command(args)
    if args.command != "chat":
        build_parser().print_help()
        return 2
    try:
        return _chat(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        from engine.errors import KVScopeError
        if isinstance(e, KVScopeError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


def _progress(fraction: float, message: str) -> None:
    print(f"[{fraction * 100:3.0f}%] {message}", file=sys.stderr, flush=True)


def _chat(args) -> int:
    from app.documents import load_document
    from app.prompt import document_messages
    from engine import LLM, EngineConfig, SamplingParams
    from engine.trace import TraceRecorder, write_chrome_trace

    doc_path = args.document or SAMPLE
    question = args.ask or (SAMPLE_QUESTION if args.document is None else None)
    if not question or not question.strip():
        print("error: --ask needs a question", file=sys.stderr)
        return 2
    document = load_document(doc_path)  # before the model: bad input fails fast
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_new_tokens, seed=args.seed)
    recorder = None
    if args.trace is not None:
        recorder = TraceRecorder(max_steps=args.max_new_tokens + 64,
                                 device=EngineConfig(device=args.device).resolve_device())
    llm = LLM(args.model, progress=_progress, recorder=recorder, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, mode=args.mode, ring_slots=args.ring_slots,
              gpu_kv_budget_gb=args.gpu_kv_budget, host_kv_gb=args.host_kv_gb,
              prefill_chunk_tokens=args.prefill_chunk, kv_block_size=args.block_size, policy=args.policy,
              policy_params=policy_params(args), kv_store=None if args.no_kv_store else args.kv_store,
              kv_store_gb=args.kv_store_gb)
    messages = document_messages(document.text, question, document.name, args.system)
    answer = []
    stats = None
    for chunk in llm.stream(messages, params):
        if chunk.stats is not None:
            stats = chunk.stats
        elif chunk.text:
            answer.append(chunk.text)
            if not args.json:
                print(chunk.text, end="", flush=True)
    if args.json:
        print(json.dumps({"answer": "".join(answer), "document": str(doc_path), "question": question,
                          "model": llm.model_name, "device": str(llm.device), "mode": args.mode,
                          "policy": llm.config.policy, "policy_params": llm.config.policy_params,
                          **({"plan": llm.plan.to_dict()} if llm.plan is not None else {}),
                          "dtype": str(llm.dtype).removeprefix("torch."), **stats.to_dict()}, indent=2))
    else:
        print("\n")
        disk = f", {stats.disk_cached_tokens} of them from disk" if stats.disk_cached_tokens else ""
        print(f"prompt {stats.prompt_tokens} tok ({stats.cached_tokens} cached{disk}) · answer {stats.completion_tokens} "
              f"tok · TTFT {stats.ttft_s:.2f} s · prefill {stats.prefill_tok_s:,.0f} tok/s · decode "
              f"{stats.decode_tok_s:.1f} tok/s · {stats.finish_reason}", file=sys.stderr)
        if args.mode != "gpu":
            print(f"{args.mode}: KV moved host->device {stats.bytes_h2d / 2**20:,.1f} MiB, device->host "
                  f"{stats.bytes_d2h / 2**20:,.1f} MiB", file=sys.stderr)
    llm.close()                                   # the disk tier's last writes
    if recorder is not None:
        path = write_chrome_trace(list(recorder.steps), args.trace)
        print(f"trace: {len(recorder.steps)} steps written to {path} (open it in https://ui.perfetto.dev)",
              file=sys.stderr)
    return 0
