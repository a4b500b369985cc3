"""Gather KV rows (tokens) per kv head from the host pool into a packed device buffer, in one kernel.

A decode policy that loads part of a layer's KV (Quest, StreamingLLM) names, per kv head, the tokens to bring:
`rows[h, j]` is a token of the layer's host pool (block * block_size + offset), packed at position j of the
buffer, or at `dst_rows[h, j]` when given (a correction that replaces some rows in place). A row of -1 is
skipped. The work is cut in chunks of R rows of one kv head, K or V (each row D contiguous elements), and a
small fixed grid of PROGRAMS programs loops over them: on CUDA the source is the pinned host pool seen through
its device mapping, so the reads cross PCIe once, straight into place (no staging copy), and a program spends
most of its time waiting on PCIe. One program per chunk (thousands) filled the GPU's thread slots with waiting
loads and starved the compute stream's kernels running beside the copy (measured on an H100, Quest at 128K: a
100 KB device copy took 170 µs instead of 3); a few dozen programs keep enough reads in flight for PCIe's pace
and leave the SMs to the compute. Runs of consecutive tokens (a page) are consecutive addresses.
`gather_rows_reference` is the same operation in torch: the CPU path and the test reference.

Layouts (elements): src [blocks, 2, Hkv, block_size, D] (one layer of the host pool), dst
[slot_blocks, 2, Hkv, block_size, D]; token t of either is block t // block_size, offset t % block_size.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None

ROWS = 128      # rows per chunk (32 KiB of a 128-dim bf16 head): more bytes in flight per program. H100, Quest at 128K,
                # budget 2048, GPU time of a step's gathers: 7.06 ms at 32 rows, 6.77 at 64, 6.45 at 128, 6.23 at 256
                # (the compute stream's busy time 13.48 -> 13.3 ms: the copy stream's loads gain most)
PROGRAMS = 32   # programs looping over the chunks (see the module docstring)
# A fetch one layer ahead runs beside the compute stream's own correction, which the layer waits for: fewer programs
# there and more here give the correction more of PCIe (H200, Quest look_ahead at 32K: 16 and 64 17.1 ms/token,
# 32 and 32 18.7; without look_ahead 32 or 128 here made no difference).
AHEAD_PROGRAMS, FIX_PROGRAMS = 16, 64
WARPS = 4       # warps per program


def gather_rows_reference(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor,
                          dst_rows: torch.Tensor | None = None) -> None:
    nb, two, hkv, bs, d = src.shape
    n = rows.shape[1]
    rows = rows.to(src.device)
    heads = torch.arange(hkv, device=src.device)[:, None].expand(hkv, n)
    to = (torch.arange(n, device=src.device)[None].expand(hkv, n) if dst_rows is None
          else dst_rows.to(src.device))
    keep = rows >= 0
    r, h, t = rows[keep], heads[keep], to[keep]
    vals = src[r // bs, :, h, r % bs].to(dst.device)                  # [m, 2, D]
    t, h = t.to(dst.device), h.to(dst.device)
    dst[t // bs, :, h, t % bs] = vals


if triton is not None:
    # n and chunks change with every decode step's row count: specializing on them (n % 16 == 0 is another
    # compiled kernel) made a step ~110 ms once a row count first reached a multiple of 16 (H200, Qwen3-4B at 128K)
    @triton.jit(do_not_specialize=["n", "chunks"])
    def _gather_rows_kernel(src, dst, rows, dst_rows, n, chunks, s_row, s_dst, s_blk, s_kv, s_head, s_tok, d_blk, d_kv,
                            d_head, d_tok, BS: tl.constexpr, R: tl.constexpr, D: tl.constexpr, HAS_DST: tl.constexpr):
        per_head = tl.cdiv(n, R)
        cols = tl.arange(0, D)[None, :]
        for c in range(tl.program_id(0), chunks, tl.num_programs(0)):   # chunk c: (K or V, head, rows j)
            kv = c % 2
            h = (c // 2) // per_head
            j = ((c // 2) % per_head) * R + tl.arange(0, R)
            inside = j < n
            tok = tl.load(rows + h * s_row + j, mask=inside, other=-1).to(tl.int64)
            if HAS_DST:
                to = tl.load(dst_rows + h * s_dst + j, mask=inside, other=-1).to(tl.int64)
            else:
                to = j.to(tl.int64)
            ok = (tok >= 0) & inside
            base = (tok // BS) * s_blk + kv * s_kv + h * s_head + (tok % BS) * s_tok
            x = tl.load(src + base[:, None] + cols, mask=ok[:, None], other=0.0)
            out = (to // BS) * d_blk + kv * d_kv + h * d_head + (to % BS) * d_tok
            tl.store(dst + out[:, None] + cols, x, mask=ok[:, None])


def gather_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, dst_rows: torch.Tensor | None = None,
                programs: int = PROGRAMS) -> None:
    """dst <- per-head rows of src (see the module docstring). rows (and dst_rows): int64 [Hkv, n] on dst's device,
    each head's row contiguous (a column slice of a wider tensor is fine)."""
    if triton is None or src.stride(-1) != 1 or dst.stride(-1) != 1:
        return gather_rows_reference(src, dst, rows, dst_rows)
    hkv, n = rows.shape
    if n == 0:
        return
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()       # a view of a plan: rows may be strided
    dst_rows = rows if dst_rows is None else dst_rows if dst_rows.stride(-1) == 1 else dst_rows.contiguous()
    chunks = hkv * triton.cdiv(n, ROWS) * 2
    args = (src, dst, rows, dst_rows, n, chunks, rows.stride(0), dst_rows.stride(0), *src.stride()[:4],
            *dst.stride()[:4], src.shape[3], ROWS, src.shape[4], dst_rows is not rows)
    grid = (min(chunks, programs),)
    key = (src.device, src.dtype, dst.dtype, rows.dtype, dst_rows.dtype, *(t.data_ptr() % 16 for t in args[:4]),
           *args[6:], WARPS)
    kernel = _COMPILED.get(key)
    if kernel is not None:
        kernel[grid + (1, 1)](*args)             # (the compiled launcher takes all three grid sizes)
        return
    kernel = _gather_rows_kernel[grid](*args, num_warps=WARPS)
    if DIRECT_LAUNCH and hasattr(kernel, "__getitem__"):       # (not under the interpreter)
        _COMPILED[key] = kernel


# Compiled kernels by what they were specialized on (the pointers' 16-byte alignment, the dtypes, the strides, the
# constants; n and chunks are not specialized on), launched directly from the second call on. A load at decode is
# launched from Python every layer (34 a step at 128K on the Qwen3-4B shape), and the JIT's launch binds and
# specializes every argument each time; a whole `gather_rows` call took 42-48 µs of host time on the H100's host.
# The compiled kernel's own launcher takes the same arguments (all of them, constants included, in order) without
# that work. That is how the JIT itself launches in Triton 3.6 and 3.9 (read in their source; run on the device's
# 3.6): older versions, whose convention was not checked, take the JIT's path every time.
DIRECT_LAUNCH = triton is not None and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
_COMPILED: dict[tuple, object] = {}
