"""Headless command line: `python main.py chat --document FILE --ask "..."` streams the answer.

`kvscope` / `python main.py` with no arguments opens the desktop app (app/gui.py); `python main.py chat` with no
options runs the chat on the bundled sample document and its sample question.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.errors import ConfigError
from engine.sparse import SPECS, get_spec, parse_policy_spec   # torch-free: the policies' specs only

from app.samples import SAMPLE, SAMPLE_QUESTION


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
    c.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="layerwise prefill: rows per QKV/MLP chunk (bounds activation memory; default: as many as keep "
                   "the MLP's activations under 256 MiB, at least 8192)")
    c.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    _add_policy_arguments(c)
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
    c.add_argument("--record", type=Path, default=None, metavar="FILE", help="save the turn as a recording "
                   "(everything the app's views show, with the document and the answer): open it with `python main.py "
                   "FILE`, on any machine, without the model")
    r = sub.add_parser("render", help="write recordings' views as PNGs (two: and a comparison sheet), offscreen, "
                       "without a model or a GPU")
    r.add_argument("recordings", nargs="+", metavar="FILE.kvscope", help="one recording, or two to compare")
    r.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the PNGs go (a folder per "
                   "recording; for two, compare/ with the comparison sheet)")
    r.add_argument("--size", default="1600x1000", help="window size WxH")
    m = sub.add_parser("compare", help="open two recordings side by side")
    m.add_argument("a", metavar="A.kvscope")
    m.add_argument("b", metavar="B.kvscope")
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


# ---------------------------------------------------------------------- policy flags, generated from the specs
class _PolicyChoices(list):
    """`--policy`'s choices: the policy names (as listed in help and errors), each also with inline parameters,
    "quest:token_budget=1024:page_size=16" (the bench's syntax)."""

    def __contains__(self, value) -> bool:
        return isinstance(value, str) and list.__contains__(self, value.split(":", 1)[0])


class _PolicyFlag(argparse.Action):
    """Stores a generated policy flag's value (True for a bool flag) and the spelling typed, for messages."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        vars(namespace).setdefault("policy_flags_typed", {})[self.dest] = option_string


def policy_flags() -> dict[str, list]:
    """Each generated flag (without '--') -> the (spec, param) pairs it sets; a flag shared by several policies
    (the same `Param.flag`) lists one pair per policy. Aliases are not keys (they name the same argument)."""
    flags: dict[str, list] = {}
    for spec in SPECS.values():
        for param in spec.params:
            flag = param.flag or f"{spec.name}-{param.name.replace('_', '-')}"
            owners = flags.setdefault(flag, [])
            if owners and (owners[0][1].type is not param.type or owners[0][1].aliases != param.aliases
                           or any(s is spec for s, _ in owners)):
                raise ValueError(f"--{flag} is shared by {owners[0][0].name} and {spec.name} with different types "
                                 "or aliases, or twice by one policy: give the params their own flags")
            owners.append((spec, param))
    return flags


def _dest(flag: str) -> str:
    return "policy_flag_" + flag.replace("-", "_")


def _policy_flag_help(owners: list) -> str:
    def one(param) -> str:
        extra = ("default: off" if param.type is bool
                 else f"{param.describe_range()}; default: {param.default}")
        return f"{param.help} ({extra})"
    described = {one(param) for _, param in owners}
    if len(described) == 1:
        text = f"{'/'.join(spec.name for spec, _ in owners)}: {described.pop()}"
    else:
        text = "; ".join(f"{spec.name}: {one(param)}" for spec, param in owners)
    return text.replace("%", "%%")


def _add_policy_arguments(c: argparse.ArgumentParser) -> None:
    """`--policy` and one flag per policy parameter (plus its aliases), all from engine.sparse.SPECS. The flags
    default to None (not given): the defaults are the specs'."""
    listing = "; ".join(f"{s.name} ({s.title}: {s.phase}, {'/'.join(s.modes)} mode)" for s in SPECS.values())
    c.add_argument("--policy", choices=_PolicyChoices(SPECS), default="full", metavar="POLICY[:KEY=VALUE...]",
                   help=f"sparse attention policy: {listing}. Its parameters come from the flags below or inline, "
                   "e.g. quest:token_budget=1024:page_size=16 (default: full)".replace("%", "%%"))
    g = c.add_argument_group("policy parameters", "each applies to the policy (or policies) named at the start "
                             "of its help; a value out of range, or one for a policy not chosen, is refused before "
                             "the model loads")
    for flag, owners in policy_flags().items():
        param = owners[0][1]
        names = [f"--{flag}", *(f"--{a}" for a in param.aliases)]
        kind = ({"nargs": 0} if param.type is bool
                else {"type": param.type, "metavar": "N" if param.type is int else "X"})
        g.add_argument(*names, dest=_dest(flag), action=_PolicyFlag, default=None, help=_policy_flag_help(owners),
                       **kind)


def policy_name(args) -> str:
    """The chosen policy's name (`--policy quest:token_budget=1024` -> "quest")."""
    return args.policy.split(":", 1)[0]


def policy_params(args) -> dict:
    """The chosen policy's parameters given on the command line (inline in `--policy` or as flags), checked
    against its spec: ConfigError for a value out of range, or a flag of a policy that is not the chosen one.
    Parameters not given are left out (the engine takes the spec's defaults)."""
    name = policy_name(args)
    spec = get_spec(name)
    params: dict = {}
    if ":" in args.policy:
        parsed = parse_policy_spec(args.policy)
        if len(parsed) != 1:
            raise ConfigError(f"--policy takes one policy, not {args.policy!r}")
        params = dict(parsed[0][1])
    typed = getattr(args, "policy_flags_typed", {})
    for flag, owners in policy_flags().items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        said = typed.get(_dest(flag), f"--{flag}")
        mine = [param for s, param in owners if s.name == name]
        if not mine:
            applies = " or ".join(f"--policy {s.name}" for s, _ in owners)
            raise ConfigError(f"{said} applies to {applies}, not --policy {name}")
        key = mine[0].name
        if key in params and params[key] != value:
            raise ConfigError(f"{name} {key} is given twice: {params[key]} in --policy and {value} by {said}")
        params[key] = value
    checked = spec.validate(params)
    return {key: checked[key] for key in params}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        from app.gui import run
        return run(sys.argv[:1])
    if len(argv) == 1 and argv[0].endswith(".kvscope"):   # `python main.py run.kvscope`: open a recording
        from app.gui import run_recording
        return run_recording(argv[0])
    args = build_parser().parse_args(argv)
    import warnings
    warnings.showwarning = _one_line_warning
    if args.command == "kv-store":
        return kv_store_command(args)
    if args.command in ("render", "compare"):
        return _recordings_command(args)
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


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings reach the user as one line each (no source file, line number or code)."""
    print(f"warning: {message}", file=file or sys.stderr, flush=True)


def _progress(fraction: float, message: str) -> None:
    print(f"[{fraction * 100:3.0f}%] {message}", file=sys.stderr, flush=True)


def check_output_path(path: Path, what: str, example: str = "trace.json") -> None:
    """Before any work: `path` can be written, else one ConfigError line naming the path and the fix."""
    from engine.paths import output_file_problem
    if (problem := output_file_problem(path, example)) is not None:
        raise ConfigError(f"{what} {path}: {problem}")


def _chat(args) -> int:
    policy, policy_kwargs = policy_name(args), policy_params(args)   # first: a bad value fails before any work
    if args.trace is not None:
        check_output_path(args.trace, "--trace")
    if args.record is not None:
        check_output_path(args.record, "--record", "run.kvscope")
    from engine.config import check_config
    engine = dict(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  mode=args.mode, ring_slots=args.ring_slots, gpu_kv_budget_gb=args.gpu_kv_budget,
                  host_kv_gb=args.host_kv_gb, prefill_chunk_tokens=args.prefill_chunk, kv_block_size=args.block_size,
                  policy=policy, policy_params=policy_kwargs, kv_store=None if args.no_kv_store else args.kv_store,
                  kv_store_gb=args.kv_store_gb)
    check_config(**engine)        # every setting, the policy's mode, the model folder and its tokenizer files
    from app import heap
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
    device = EngineConfig(device=args.device).resolve_device()
    if args.trace is not None:                        # every step's timeline
        recorder = TraceRecorder(max_steps=args.max_new_tokens + 64, device=device)
    elif args.record is not None:                     # as the app records (a decode timeline 3-10 times a second)
        recorder = TraceRecorder.live(device, max_steps=args.max_new_tokens + 64, mode=args.mode)
    with LLM(progress=_progress, recorder=recorder, **engine) as llm:   # closed at the end: threads joined, last writes done
        llm.warm_up(_progress)                        # CUDA: compiled and captured before the question, not in it
        heap.freeze()                                 # what the engine holds, out of later full collections
        messages = document_messages(document.text, question, document.name, args.system)
        first_step = recorder.steps[-1].step + 1 if recorder is not None and recorder.steps else 0
        ids = llm.tokenize_turn(messages)             # once: the engine and the recording's token map take them
        conversation, doc_tokens = _begin_record(args, llm, messages, ids, document, first_step)
        answer = []
        stats = None
        for chunk in llm.stream(messages, params, prompt_ids=ids):
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
        if conversation is not None:
            _save_record(args, llm, conversation, question, "".join(answer), stats, engine, document,
                         [s for s in recorder.steps if s.step >= first_step], doc_path, doc_tokens.result())
    if args.trace is not None:
        path = write_chrome_trace(list(recorder.steps), args.trace)
        print(f"trace: {len(recorder.steps)} steps written to {path} (open it in https://ui.perfetto.dev)",
              file=sys.stderr)
    return 0


def _begin_record(args, llm, messages: list[dict], ids: list[int], document, first_step: int):
    """--record: the turn's Conversation, with the token map Quest's pages are shown in the document by, and the
    document's tokens as the window counts them (a Future: counted on a thread while the turn runs; the tokenizer
    lets go of the GIL, so the engine's thread does not wait: ~0.4 s for 115K tokens on a 2-core CPU)."""
    if args.record is None:
        return None, None
    from concurrent.futures import ThreadPoolExecutor

    from app.prompt import document_messages
    from app.quest_highlight import token_char_map
    from app.record import Conversation
    conversation = Conversation()
    if llm.runner.policy.plans_loads:
        token_map, why = token_char_map(llm.tokenizer, messages, ids, document.text)
        conversation.begin_turn({"map": token_map, "reason": why, "first_step": first_step})
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvscope-count")
    tokens = pool.submit(lambda: len(llm.chat_prompt_ids(document_messages(document.text, "", document.name))))
    pool.shutdown(wait=False)                          # (the count runs on; `tokens.result()` waits for it)
    return conversation, tokens


def _save_record(args, llm, conversation, question: str, answer: str, stats, engine: dict, document, steps: list,
                 doc_path: Path, tokens: int) -> None:
    from app.record import model_info, turn_stats
    from engine.trace.recording import save_recording
    conversation.end_turn(question, answer, turn_stats(stats, llm), engine, steps)
    meta = {"origin": "command line", "device": str(llm.device),
            "app": {"model": model_info(llm), "engine": engine, "sampling": {
                        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                        "max_tokens": args.max_new_tokens, "seed": args.seed},
                    "system_prompt": args.system or "",
                    "document": {"name": document.name, "path": str(doc_path), "tokens": tokens,
                                 "encoding": document.encoding if document.kind != "pdf" else ""}}}
    t0 = time.perf_counter()
    path = save_recording(conversation.recording(document.text, meta), args.record)
    print(f"recording: {len(steps)} steps, {path.stat().st_size / 2**20:,.1f} MiB written to {path} in "
          f"{time.perf_counter() - t0:.2f} s (open it with `python main.py {path}`)", file=sys.stderr)


def _recordings_command(args) -> int:
    """`render` and `compare`: one line and exit 2 for a file that is not a recording or a bad output folder."""
    from engine.paths import output_folder_problem
    from engine.trace.recording import RecordingError, load_recording
    try:
        if args.command == "compare":
            from app.compare_window import CompareWindow
            from app.gui import _application
            a, b = load_recording(args.a), load_recording(args.b)
            app = _application(sys.argv[:1])
            window = CompareWindow(a, b)
            window.show()
            return app.exec()
        if len(args.recordings) > 2:
            raise ConfigError("render takes one recording, or two to compare")
        if (problem := output_folder_problem(args.out)) is not None:
            raise ConfigError(f"--out {args.out}: {problem}")
        parts = args.size.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"--size {args.size}: give the window size as WIDTHxHEIGHT, e.g. 1600x1000")
        size = (int(parts[0]), int(parts[1]))
        from app.render import render
        written = render(args.recordings, args.out, size)
    except (RecordingError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
