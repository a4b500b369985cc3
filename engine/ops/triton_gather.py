"""Gather KV pages per kv head into a packed device buffer (Quest's page loads), in one kernel.

Grid (Hkv, k, 2): a program copies one page (page_size x D) of one kv head, K or V. On CUDA the source is the
pinned host pool seen through its device mapping, so the reads cross PCIe: a program reads its page as one
[P, D] tile (contiguous rows of D elements, 16-byte vector loads), where torch's advanced indexing reads
element by element (measured about 5 GB/s on an H100 for 8 KiB pages). The torch expression in
`gather_pages_reference` is the same operation, the CPU path, and the test reference.

Layouts (elements): src [blocks, 2, Hkv, block_size, D] (one layer of the host pool), dst
[slot_blocks, 2, Hkv, block_size, D]; page p of a head is block p // ppb, tokens (p % ppb) * P ...; packed page j
of head h lands at dst block j // ppb, tokens (j % ppb) * P ... of that head.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None


def gather_pages_reference(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, page_size: int) -> None:
    nb, two, hkv, bs, d = src.shape
    ppb = bs // page_size
    k = pages.shape[1]
    s = src.view(nb, two, hkv, ppb, page_size, d)
    t = dst.view(dst.shape[0], two, hkv, ppb, page_size, d)
    heads = torch.arange(hkv, device=pages.device)[:, None].expand(hkv, k)
    pos = torch.arange(k, device=pages.device)[None].expand(hkv, k)
    t[(pos // ppb).to(dst.device), :, heads.to(dst.device), (pos % ppb).to(dst.device)] = \
        s[pages // ppb, :, heads, pages % ppb].to(dst.device)


if triton is not None:
    @triton.jit
    def _gather_kernel(src, dst, pages, k, s_blk, s_kv, s_head, s_tok, d_blk, d_kv, d_head, d_tok,
                       PPB: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
        h = tl.program_id(0)
        j = tl.program_id(1)
        kv = tl.program_id(2)
        page = tl.load(pages + h * k + j).to(tl.int64)
        rows = tl.arange(0, P)[:, None]
        cols = tl.arange(0, D)[None, :]
        base = (page // PPB) * s_blk + kv * s_kv + h * s_head + ((page % PPB) * P) * s_tok
        x = tl.load(src + base + rows * s_tok + cols)
        jj = j.to(tl.int64)
        out = (jj // PPB) * d_blk + kv * d_kv + h * d_head + ((jj % PPB) * P) * d_tok
        tl.store(dst + out + rows * d_tok + cols, x)


def gather_pages(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, page_size: int) -> None:
    """dst <- per-head pages of src (see the module docstring). pages: int64 [Hkv, k] on dst's device."""
    if triton is None or src.stride(-1) != 1 or dst.stride(-1) != 1:
        return gather_pages_reference(src, dst, pages, page_size)
    hkv, k = pages.shape
    bs, d = src.shape[3], src.shape[4]
    pages = pages.contiguous()
    _gather_kernel[(hkv, k, 2)](src, dst, pages, k, *src.stride()[:4], *dst.stride()[:4],
                                PPB=bs // page_size, P=page_size, D=d, num_warps=4)
