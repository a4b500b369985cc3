"""The row gather's pace from the pinned host pool against the copy engine's, on CUDA: what Quest's correction moves.

    python tools/gather_pace.py --programs 16,32,64,128 --rows 64,128,256 --warps 4,8

One layer of a Qwen3-4B-shaped host pool at 128K tokens (pinned), per kv head `--budget / --page` random pages of
`--page` tokens (Quest's correction with random weights fetches nearly all of them), gathered into a packed device
buffer by engine/ops/triton_gather.py with each grid size, chunk size and warp count; against one contiguous copy
of the same bytes by the copy engine (`copy_`, non_blocking). Medians of --repeats, CUDA events, GB/s of the bytes
moved. The program count that reaches PCIe's pace in the fewest programs leaves the most SMs to the compute beside it.
"""
import argparse

import torch

from bench.kernels import _time_ms as timed
from engine.ops import triton_gather as g


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--programs", default="16,32,64,128,256")
    p.add_argument("--rows", default="64,128,256")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("it times CUDA kernels: run it on a machine with a CUDA GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    nb, bs, hkv, d = a.tokens // a.block, a.block, a.heads, a.dim
    src = torch.randn(nb, 2, hkv, bs, d, dtype=dt).pin_memory()
    slots = -(-a.budget // bs)
    dst = torch.empty(slots, 2, hkv, bs, d, dtype=dt, device=dev)
    pages = a.budget // a.page
    chosen = torch.stack([torch.randperm(a.tokens // a.page)[:pages] for _ in range(hkv)])      # [Hkv, pages]
    rows = (chosen[:, :, None] * a.page + torch.arange(a.page)).flatten(1).to(dev)             # [Hkv, budget]
    ref = torch.zeros_like(dst)
    g.gather_rows_reference(src, ref, rows.cpu())
    nbytes = rows.numel() * 2 * d * src.element_size()
    flat = torch.empty(nbytes // src.element_size(), dtype=dt).pin_memory()
    flat_dst = torch.empty_like(flat, device=dev)
    ms = timed(lambda: flat_dst.copy_(flat, non_blocking=True), a.repeats)
    print(f"{nbytes / 2 ** 20:.1f} MiB a layer ({hkv} kv heads x {pages} pages of {a.page} tokens, K and V); "
          f"{torch.cuda.get_device_name()}")
    print(f"copy engine, one contiguous copy: {ms * 1e3:.0f} us, {nbytes / ms / 1e6:.1f} GB/s")
    print(f"{'programs':>8} {'rows':>5} {'warps':>5} {'us':>7} {'GB/s':>6}")
    for warps in map(int, a.warps.split(",")):
        for r in map(int, a.rows.split(",")):
            for n in map(int, a.programs.split(",")):
                g.ROWS, g.WARPS = r, warps
                dst.zero_()
                ms = timed(lambda: g.gather_rows(src, dst, rows, None, n), a.repeats)
                ok = "" if torch.equal(dst, ref) else "  WRONG"
                print(f"{n:>8} {r:>5} {warps:>5} {ms * 1e3:>7.0f} {nbytes / ms / 1e6:>6.1f}{ok}")


if __name__ == "__main__":
    main()
