"""Quest's low-rank key sketch (`rank`, engine/sparse/page_index.py KeySketch): a page scored by its best token's
logit in the leading directions of its layer's keys; the basis, when it is made and from which keys."""
import pytest
import torch

from engine.errors import ConfigError
from engine.step import StepContext
from tests.engine.test_quest import _policy


def test_the_rank_score_is_each_pages_best_token_and_exact_at_full_rank():
    """rank = head_dim: a page's score is its best key's logit exactly; a smaller rank estimates it in the
    leading directions of the layer's keys, and still finds a page whose one key points along the query where
    the bounds prefer pages of spread-out keys."""
    torch.manual_seed(3)
    exact, bounds = _policy(rank=8), _policy()
    keys = torch.randn(6, 2, 32, 8)                                  # [block, Hkv, bs, D]
    for b in range(6):
        exact.on_kv_written(1, [b], keys[b][None], 0, 32)
        bounds.on_kv_written(1, [b], keys[b][None], 0, 32)
    q, valid = torch.randn(4, 8), torch.arange(12) % 4 > 0
    true = torch.einsum("hgd,hptd->hgpt", q.reshape(2, 2, 8),
                        keys.reshape(6, 2, 2, 16, 8).permute(1, 0, 2, 3, 4).reshape(2, 12, 16, 8)).amax(-1)
    got = exact.bounds(1, q, torch.arange(12), valid)
    torch.testing.assert_close(got[:, :, valid], true[:, :, valid], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[:, :, ~valid]).all()

    # keys along a rotating pair (as RoPE turns them) of radius 3 in every page but page 4, which holds small
    # keys and one at (2.5, 2.5): its best logit is the highest (5 against 3 sqrt 2), its bound the lowest
    low, bnd = _policy(budget=48, rank=2), _policy(budget=48)      # sink 16 + 1 page + window 16
    keys = torch.randn(6, 2, 32, 8) * 0.05
    phi = torch.rand(6, 2, 32) * 6.2832
    keys[..., 0], keys[..., 1] = 3 * phi.cos(), 3 * phi.sin()
    keys[2, :, :16, :2] = 0.05
    keys[2, :, 5, :2] = 2.5
    for p in (low, bnd):
        for b in range(6):
            p.on_kv_written(0, [b], keys[b][None], 0, 32)
    q = torch.zeros(4, 8)
    q[:, :2] = 1.0
    for p, want in ((low, True), (bnd, False)):
        p.observe_query(0, q, StepContext(block_table=torch.arange(6), context_len=192))
        assert (p._pages[0] == 4).any(dim=1).all().item() is want


def test_rank_replaces_the_bounds():
    with pytest.raises(ConfigError, match="pass rank=0 with them"):
        _policy(rank=4, centroid=True)


def test_the_sketch_basis_spans_the_leading_eigenvectors():
    """The sketch's basis (subspace iteration, no eigh): orthonormal, the span of the r leading eigenvectors where
    the spectrum has a gap, and still orthonormal and finite for keys of lower rank than r, or none at all."""
    from engine.sparse.page_index import leading_directions
    torch.manual_seed(0)
    u = torch.linalg.qr(torch.randn(3, 16, 16, dtype=torch.float64)).Q
    values = torch.cat([torch.rand(3, 4) + 2, torch.rand(3, 12) * 0.3], 1).double()   # 4 leading, then a gap
    m = u @ torch.diag_embed(values) @ u.transpose(1, 2)
    q = leading_directions(m, 4)
    lead = u[:, :, :4]
    eye = torch.eye(4, dtype=q.dtype).expand(3, 4, 4)
    torch.testing.assert_close(q.transpose(1, 2) @ q, eye)
    torch.testing.assert_close(q @ q.transpose(1, 2), lead @ lead.transpose(1, 2), atol=1e-6, rtol=0)
    keys = (torch.randn(2, 50, 3) @ torch.randn(2, 3, 16)).double()              # rank 3 < r = 8
    q = leading_directions(keys.transpose(1, 2) @ keys, 8)
    torch.testing.assert_close(q.transpose(1, 2) @ q, torch.eye(8, dtype=q.dtype).expand(2, 8, 8))
    inside = torch.linalg.matrix_norm(q @ q.transpose(1, 2) @ keys.transpose(1, 2))
    torch.testing.assert_close(inside, torch.linalg.matrix_norm(keys))              # the keys' span is in it
    assert leading_directions(torch.zeros(1, 16, 16), 4).isfinite().all()


def test_before_its_basis_the_sketch_keeps_aside_only_the_completed_pages_tokens():
    """A short prompt's layer waits for CALIBRATION keys (or its first choice) before it has a basis: what it keeps
    aside meanwhile is the tokens of the pages completed, not the whole blocks they are in (a page at a time at
    decode), and once the basis is made they score as if written after it."""
    p = _policy(rank=4, bs=64, blocks=3)
    keys = torch.randn(2, 64, 8)
    p.on_kv_written(0, [2], keys[None], 0, 40)                      # pages 0, 1 complete; 8 tokens of page 2
    p.on_kv_written(0, [2], keys[None], 40, 48)                     # page 2 completes
    assert [k.shape for _, k in p.index.pending[0]] == [(2, 32, 8), (2, 16, 8)]
    q, pages = torch.randn(4, 8), torch.arange(8, 11)               # pool pages of block 2 (4 pages a block)
    got = p.bounds(0, q, pages, torch.ones(3, dtype=torch.bool))    # (the basis is made here)
    basis = p.index.basis[0]                                        # [Hkv, D, r]
    want = torch.einsum("hgr,hptr->hgpt", (q.reshape(2, 2, 8) @ basis),
                        (keys[:, :48].reshape(2, 3, 16, 8) @ basis[:, None])).amax(-1)
    torch.testing.assert_close(got, want)


def test_after_forget_the_next_prompts_keys_make_the_basis():
    """The engine's warm-up runs throwaway prompts, then tells the policy to forget (LLM.warm_up): the next prompt's
    keys make the basis, as in a policy that never saw the throwaway (whose basis kept 81-92% of a real document's
    key energy on the default model), and in place (the selection graphs read it where it is)."""
    torch.manual_seed(5)
    fresh, used = _policy(rank=2, bs=64, blocks=3), _policy(rank=2, bs=64, blocks=3)
    throwaway, real = torch.randn(2, 64, 8), torch.randn(2, 64, 8)
    throwaway[..., :2] *= 10                                        # their leading directions differ
    real[..., 6:] *= 10
    q, valid = torch.randn(4, 8), torch.ones(4, dtype=torch.bool)
    used.on_kv_written(0, [0], throwaway[None], 0, 64)
    used.bounds(0, q, torch.arange(4), valid)                       # its basis: the throwaway's
    storage = used.index.basis.data_ptr()
    used.forget()
    for p in (fresh, used):
        p.on_kv_written(0, [1], real[None], 0, 64)
    got, want = (p.bounds(0, q, torch.arange(4, 8), valid) for p in (used, fresh))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(used.index.basis, fresh.index.basis)
    assert used.index.basis.data_ptr() == storage
