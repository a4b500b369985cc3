"""Quest's page bound and selection (the math, on random data)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sparse.policy import KVLayout
from engine.sparse.quest import QuestPolicy


def _policy(hkv=2, d=8, bs=32, page=16, blocks=6, budget=64, dense_layers=0):
    p = QuestPolicy(token_budget=budget, page_size=page, dense_layers=dense_layers)
    p.initialize(KVLayout(2, hkv, d, bs, torch.device("cpu"), torch.float32, blocks))
    return p


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), g=st.sampled_from([1, 2, 4]), scale=st.floats(0.1, 10.0))
def test_page_bound_is_at_least_the_true_max(seed, g, scale):
    torch.manual_seed(seed)
    p = _policy()
    keys = torch.randn(6, 2, 32, 8) * scale                       # [block, Hkv, bs, D]
    for b in range(6):
        p.on_prefill_offload(b, 1, keys[b], 32)
    q = torch.randn(2 * g, 8) * scale                              # [Hq, D]
    pages = p.page_ids(range(6))
    bound = p.scores(1, q, pages)                                  # [Hkv, 12]
    k_pages = keys.reshape(6, 2, 2, 16, 8).permute(1, 0, 2, 3, 4).reshape(2, 12, 16, 8)
    true = torch.einsum("hgd,hptd->hgpt", q.reshape(2, g, 8), k_pages).amax(-1).amax(1)   # [Hkv, 12]
    assert (bound >= true - 1e-4 * (1 + true.abs())).all()


def test_selection_is_per_kv_head_with_sink_and_recent():
    torch.manual_seed(0)
    p = _policy(budget=64)                                          # 64 tokens = 2 blocks = 4 pages per kv head
    keys = 0.01 * torch.randn(6, 2, 32, 8)                          # [block, Hkv, bs, D]: 12 pages of 16
    keys[2, 0, :, 0] = 5.0                                          # pages 4, 5: large keys on kv head 0 only
    keys[4, 1, :, 1] = 5.0                                          # pages 8, 9: large keys on kv head 1 only
    for b in range(6):
        p.on_decode_offload(b, 0, keys[b], 32)
    q = torch.zeros(4, 8)
    q[:, 0] = q[:, 1] = 1.0                                         # every query head looks for both
    top, scores = p.select(0, q, list(range(6)))
    assert top.tolist() == [[0, 4, 5, 11], [0, 8, 9, 11]]          # per head; sink and most recent always in
    assert (scores[0, 1:3] > 4).all() and (scores[1, 1:3] > 4).all()


def test_dense_below_the_budget_and_in_dense_layers():
    p = _policy(budget=64, dense_layers=1)
    assert not p.applies(0, 6)           # a dense layer
    assert not p.applies(1, 2)           # 4 pages fit the budget of 4
    assert p.applies(1, 3)
