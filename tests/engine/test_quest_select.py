"""Quest's choice and correction kernels (Triton: the interpreter on CPU, compiled on a GPU) against their torch
versions, and the torch versions against what they promise."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.quest_select import choose, choose_reference, correct, correct_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bounds(hkv, g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(hkv, g, n, generator=gen) * 4
    valid = torch.rand(n, generator=gen) < 0.7
    valid[-3:] = False                                                   # pages the sequence does not have
    return b.masked_fill_(~valid, float("-inf")).to(DEV), valid


@pytest.mark.parametrize("hkv,g,n,k", [(2, 3, 300, 7), (1, 4, 2100, 64), (3, 1, 80, 28),   # 2100: 5 chunks
                                     (2, 4, 8200, 128)])                      # 17 chunks of 512 pages
def test_choice_kernel_equals_reference(hkv, g, n, k):
    b, valid = _bounds(hkv, g, n, seed=n)
    prev = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(h))[:k] for h in range(hkv)]).to(DEV)
    want, want_s, want_kept = choose_reference(b, 0.3, k, prev)
    pages = prev.clone()                                                 # written in place of the previous choice
    scores = torch.zeros(hkv, k, device=DEV)
    kept = torch.zeros(hkv, dtype=torch.int32, device=DEV)
    choose(b, 0.3, k, pages, torch.empty(hkv, n, device=DEV), pages, scores, kept)
    assert torch.equal(pages, want) and torch.equal(kept.long(), want_kept)
    torch.testing.assert_close(scores, want_s, rtol=1e-5, atol=1e-6)
    assert valid[pages.cpu()].all()                                      # candidates only
    assert torch.equal(scores[:, -1], scores.min(1).values)              # the lowest-scored page is last


@pytest.mark.parametrize("k", [12, 6])                              # the cut among the tail's ties, or before them
@pytest.mark.parametrize("n", [300, 8200])
def test_choice_kernel_takes_equal_scores_in_page_order(n, k):
    """Pages with equal scores in several chunks (8200 pages: 17 chunks of 512, the last one's candidates in the
    merge's tail): the ones cut at the k-th score are taken in page order, the last taken goes last."""
    hkv, g = 1, 2
    b = torch.full((hkv, g, n), -30.0)
    tied = torch.tensor([3, 40, 200, 255, 256, 257, n - 20, n - 9, n - 6, n - 4])       # (n - 3.. are not pages)
    b[..., tied] = 5.0
    b[..., [7, 100, 260]] = 6.0                                                         # three above the tie
    b[..., -3:] = float("-inf")
    b = b.to(DEV)
    prev = torch.zeros(hkv, k, dtype=torch.long, device=DEV)
    pages = torch.zeros(hkv, k, dtype=torch.long, device=DEV)
    scores = torch.zeros(hkv, k, device=DEV)
    kept = torch.zeros(hkv, dtype=torch.int32, device=DEV)
    choose(b, 1.0, k, prev, torch.empty(hkv, n, device=DEV), pages, scores, kept)
    take = tied[:k - 3].tolist()                                                        # the first tied, in order
    assert pages[0].tolist() == sorted([7, 100, 260] + take[:-1]) + [take[-1]]


@pytest.mark.parametrize("live", [300, 1500, 8190])   # one chunk, three, all 17 (n 8200)
def test_choice_kernel_reads_only_the_live_pages(live):
    """A graph captured for max_model_len's pages chooses among the sequence's first `live` pages only: the same
    choice as the reference over those pages, whatever the pages after them hold (garbage from other steps)."""
    hkv, g, n, k = 2, 3, 8200, 64
    b, _ = _bounds(hkv, g, n, seed=live)
    b[..., live:] = 50.0                                                 # would win every slot if it were read
    prev = torch.stack([torch.randperm(live, generator=torch.Generator().manual_seed(h))[:k] for h in range(hkv)])
    prev[:, 0] = n - 1                                                   # a stale page of a longer sequence
    prev = prev.to(DEV)
    want, want_s, want_kept = choose_reference(b[..., :live], 0.3, k, prev)
    pages, scores = torch.zeros(hkv, k, dtype=torch.long, device=DEV), torch.zeros(hkv, k, device=DEV)
    kept = torch.zeros(hkv, dtype=torch.int32, device=DEV)
    scratch = torch.full((hkv, n), 7.0, device=DEV)                      # (stale scores past live, too)
    choose(b, 0.3, k, prev, scratch, pages, scores, kept, live=torch.tensor(live, device=DEV))
    assert torch.equal(pages, want) and torch.equal(kept.long(), want_kept)
    torch.testing.assert_close(scores, want_s, rtol=1e-5, atol=1e-6)
    assert (pages < live).all()


def test_reference_choice_is_the_k_best_scores():
    b, valid = _bounds(2, 3, 200, seed=1)
    top, sc, _ = choose_reference(b, 0.5, 10, torch.zeros(2, 10, dtype=torch.long, device=DEV))
    s = torch.softmax(b * 0.5, -1).sum(1)
    for h in range(2):
        assert set(top[h].tolist()) == set(s[h].topk(10).indices.tolist())
        assert torch.equal(top[h, :-1], top[h, :-1].sort().values)       # ascending, then the lowest-scored
    assert torch.allclose(sc.sum(), s.topk(10).values.sum())


def _pairs(rows, dst):
    return [sorted(zip(dst[h][rows[h] >= 0].tolist(), rows[h][rows[h] >= 0].tolist())) for h in range(rows.shape[0])]


@pytest.mark.parametrize("case", ["some loaded", "none loaded", "lowest elsewhere", "all loaded"])
def test_correction_kernel_equals_reference(case):
    k, ps, hkv = 6, 4, 2
    page_ids = torch.arange(100, device=DEV) * 3 + 1                     # sequence page -> pool page
    new = torch.tensor([[2, 5, 9, 11, 20, 7], [1, 3, 4, 8, 9, 30]], device=DEV)   # ascending, the lowest last
    slots = {"some loaded": [[5, 40, 2, 41, 7, 42], [30, 3, 50, 1, 51, 52]],
             "none loaded": [[-1] * 6, [-1] * 6],
             "lowest elsewhere": [[7, 2, 5, 9, 11, 20], [30, 1, 3, 4, 8, 9]],   # new's last is not in the last slot
             "all loaded": [[2, 5, 9, 11, 20, 7], [9, 3, 4, 8, 1, 30]]}[case]
    slots = torch.tensor(slots, device=DEV)
    base, n_rows = torch.tensor(8, device=DEV), torch.tensor(8 + k * ps - 1, device=DEV)   # the last row is cut
    want_slots = slots.clone()
    w_rows, w_dst, w_count = correct_reference(new, want_slots, page_ids, base, n_rows, ps)
    got_slots = slots.clone()
    rows = torch.empty(hkv, k * ps, dtype=torch.long, device=DEV)
    dst = torch.empty_like(rows)
    count = torch.zeros(1, dtype=torch.long, device=DEV)
    plan = torch.full((2, hkv, 40), -7, dtype=torch.long, device=DEV)   # the next step's plan: parity 1, column 5
    par, col = torch.tensor([1], device=DEV), torch.arange(5, 5 + k * ps, device=DEV)
    wrote = correct(new, got_slots, page_ids, base, n_rows, ps, rows, dst, count, plan=(plan, par, col))
    assert torch.equal(got_slots, want_slots) and count.item() == w_count.item()
    assert wrote                                                         # the kernel wrote the chosen pages' rows
    every = (page_ids[new][:, :, None] * ps + torch.arange(ps, device=DEV)).flatten(1)
    assert torch.equal(plan[1, :, 5:5 + k * ps], every)
    assert (plan[0] == -7).all() and (plan[1, :, :5] == -7).all() and (plan[1, :, 5 + k * ps:] == -7).all()
    assert _pairs(rows, dst) == _pairs(w_rows, w_dst)
    for h in range(hkv):                                                 # the slots then hold the choice,
        assert set(want_slots[h].tolist()) == set(new[h].tolist())       # its lowest-scored page in the last
        assert want_slots[h, -1] == new[h, -1]
    pages = {"some loaded": 4, "none loaded": k, "lowest elsewhere": 2, "all loaded": 0}[case]   # per kv head
    expect = 2 * (pages * ps - (pages > 0))                              # rows fetched (the cut last row never)
    assert w_count.item() == expect


@pytest.mark.parametrize("loaded", ["nothing", "a speculation"])
def test_a_choice_with_its_correction_equals_the_two_apart(loaded):
    """choose(..., fix=...) corrects in the choice's last kernel: the same pages, slots, rows, destinations, count
    and next plan as choose() then correct(), whether the buffer held nothing (every page fetched) or a speculation."""
    hkv, g, n, k, ps = 2, 3, 2100, 24, 4
    b, _ = _bounds(hkv, g, n, seed=5)
    prev = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(h))[:k] for h in range(hkv)]).to(DEV)
    page_ids = (torch.arange(n, device=DEV) * 7) % n
    base, n_rows = torch.tensor(20, device=DEV), torch.tensor(20 + k * ps - 3, device=DEV)
    runs = []
    for fused in (False, True):
        want, _, _ = choose_reference(b, 0.3, k, prev)
        slots = torch.full((hkv, k), -1, dtype=torch.long, device=DEV)
        if loaded == "a speculation":
            slots.copy_(prev)
            slots[:, :5] = want[:, 3:8]                                  # some of the choice is in place already
        pages, scores = torch.zeros(hkv, k, dtype=torch.long, device=DEV), torch.zeros(hkv, k, device=DEV)
        kept = torch.zeros(hkv, dtype=torch.int32, device=DEV)
        rows, dst = torch.full((hkv, k * ps), -9, dtype=torch.long, device=DEV), torch.zeros(hkv, k * ps,
                                                                                           dtype=torch.long, device=DEV)
        count = torch.zeros(1, dtype=torch.long, device=DEV)
        plan = torch.full((2, hkv, 20 + k * ps), -7, dtype=torch.long, device=DEV)
        par, col = torch.tensor([0], device=DEV), torch.tensor([20], device=DEV)
        fix = (slots, page_ids, base, n_rows, ps, rows, dst, count, (plan, par, col))
        scratch = torch.empty(hkv, n, device=DEV)
        if fused:
            wrote = choose(b, 0.3, k, prev, scratch, pages, scores, kept, fix=fix)
        else:
            choose(b, 0.3, k, prev, scratch, pages, scores, kept)
            wrote = correct(pages, *fix[:8], plan=fix[8])
        assert wrote and torch.equal(pages, want)
        runs.append([pages, slots, rows, dst, count, plan])
    assert all(torch.equal(a, c) for a, c in zip(*runs))
    fetched = (runs[1][2] >= 0).sum().item()
    assert runs[1][4].item() == fetched and (fetched < hkv * (k * ps - 3)) == (loaded == "a speculation")
