"""The app's engine process against the command line's engine, turn for turn, without a window.

    python tools/engine_process_cost.py [--mode layerwise] [--rounds 8] [--tokens 64] [--pin CPU]

Three processes stay alive together and answer the same chat turn (the sample document and question, greedy,
`--tokens` answer tokens, EOS ignored), the order rotating every round:

  cli        the engine as `main.py chat` runs it (tools/app_overhead.py's engine-only process, untraced)
  unwatched  the app's engine process (`app.engine_process.serve`, as `python main.py` starts it) with
             View -> Watch off: it records nothing
  watched    another such process watching, as the app runs by default: the recorder on, every step sent through
             the app's outbox to this process, which reads (unpickles) them as the window's process does

Each process keeps its CPU for long, and a GPU host's CPUs run at different speeds (H100, chunked mode: one
process read 156-190 tok/s on every turn while two others with the same code read 252-268), so `--pin CPU` puts
every thread of the three on one CPU (their turns never overlap). It prints each kind's median decode tok/s and
its turns against the same round's `cli` turn. This measures the engine side of the app's cost; tools/app_overhead.py
measures the whole window (drawing included).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

QUESTION = "Summarise the document in detail, section by section."


class AppEngine:
    """The app's engine process, driven over its pipe as the window's ProcessWorker drives it (no Qt here)."""

    def __init__(self, engine: dict, document: str, tokens: int, watch: bool):
        from app.engine_process import SharedFlag, serve
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, SharedFlag(ctx)), name="kvscope-engine", daemon=True)
        self.proc.start()
        child.close()
        self.pid, self.tokens = self.proc.pid, tokens
        self.request("set_watching", watch)
        self.request("load_model", engine)
        self.request("open_document", document)
        self.turn()                                         # the document's KV into the prefix cache

    def request(self, name: str, *args) -> dict | None:
        """Send one request, read every batch until it is done; the turn's stats (answer_done) if it answered."""
        self.conn.send((name, args))
        stats = None
        while True:
            _, batch = self.conn.recv()
            for message in batch:
                if message[0] == "signal" and message[1] in ("answer_done", "error"):
                    if message[1] == "error":
                        raise RuntimeError(f"the engine process: {message[2][0]}")
                    stats = message[2][0]
                elif message[0] == "done":
                    return stats

    def turn(self) -> dict:
        self.request("new_chat")                            # the same prompt every turn: no history
        return self.request("ask", QUESTION, {"temperature": 0.0, "max_tokens": self.tokens, "ignore_eos": True}, "")

    def close(self) -> None:
        self.conn.send(("close", ()))
        self.proc.join(60)


def main() -> int:
    from app_overhead import EngineOnly, cpu_set, pin
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="layerwise")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pin", type=cpu_set, default=None, metavar="CPUS",
                    help="every thread of the three processes on this CPU, or these (3,4: the outbox thread of the "
                         "app's engine process beside its engine thread, as on an unpinned host)")
    args = ap.parse_args()

    from app.samples import SAMPLE

    engine = {"mode": args.mode}
    cli = EngineOnly(engine, str(SAMPLE), args.tokens)
    unwatched, watched = (AppEngine(engine, str(SAMPLE), args.tokens, watch) for watch in (False, True))
    turns = {"cli": lambda: cli.turn(False), "unwatched": unwatched.turn, "watched": watched.turn}
    if args.pin is not None:
        for pid in (cli.proc.pid, unwatched.pid, watched.pid):
            pin(pid, args.pin)
    names, res = list(turns), {k: [] for k in turns}
    for r in range(args.rounds):                            # the order rotates every round
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            res[name].append(float(turns[name]()["decode_tok_s"]))
    for proc in (cli, unwatched, watched):
        proc.close()
    print(f"{args.mode}, {args.tokens} tokens, {args.rounds} rounds{f', pinned to CPUs {sorted(args.pin)}' if args.pin is not None else ''}"
          ": decode tok/s (median; against the same round's cli turn)")
    for name, v in res.items():
        paired = [x / y for x, y in zip(v, res["cli"])]
        print(f"  {name:10s} {statistics.median(v):8.1f}   {statistics.median(paired):.3f}x "
              f"({min(paired):.2f}-{max(paired):.2f})   turns: " + " ".join(f"{x:.0f}" for x in v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
