"""The decode graphs' inputs (engine/model_runner.py, GraphInputs): after every write the graph's tensors hold what
a fresh build from the sequences would, though block-table rows are copied only where they changed. On the CPU
here (unpinned buffers, no event) and on CUDA (pinned, the event between steps)."""
import pytest
import torch

from engine.model_runner import GraphInputs
from engine.sampling import SamplingParams
from engine.sequence import Sequence

BS, SCRATCH, ROWS, WIDTH = 16, 99, 4, 8


def _seq(n: int, blocks: list[int]) -> Sequence:
    s = Sequence(list(range(1, n + 1)), SamplingParams(), BS)
    s.block_table = list(blocks)
    return s


def _expected(seqs: list[Sequence]) -> tuple[list, list]:
    inputs = [[0] * ROWS for _ in range(5)]
    inputs[2] = [SCRATCH] * ROWS
    for i, s in enumerate(seqs):
        last = len(s) - 1
        for r, v in enumerate((s.last_token, last, s.block_table[last // BS], last % BS, len(s))):
            inputs[r][i] = v
    return inputs, [s.block_table + [0] * (WIDTH - len(s.block_table)) for s in seqs]


def _check(gi: GraphInputs, seqs: list[Sequence]) -> None:
    gi.write(seqs)
    if gi.inputs.is_cuda:
        torch.cuda.synchronize()
    inputs, tables = _expected(seqs)
    assert gi.inputs.tolist() == inputs
    assert gi.tables[:len(seqs)].tolist() == tables


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_block_table_rows_follow_growth_moves_and_replaced_tables(device):
    gi = GraphInputs(torch.zeros(5, ROWS, dtype=torch.long, device=device),
                     torch.zeros(ROWS, WIDTH, dtype=torch.int32, device=device), BS, SCRATCH)
    assert gi.host_inputs.is_pinned() == (device == "cuda")
    a, b, c = _seq(15, [3]), _seq(40, [5, 6, 7]), _seq(2, [9])
    _check(gi, [a, b, c])
    assert gi.rows_copied == 3
    for _ in range(3):                                   # a grows into a second block at its 17th token
        for s in (a, b, c):
            s.token_ids.append(7)
        a.block_table += [11] if len(a) == 17 else []
        _check(gi, [a, b, c])
    assert gi.rows_copied == 4                           # only a's row, once: the other tables did not change
    a.block_table = [12, 13]                             # freed and allocated again: a new list of the same length
    _check(gi, [a, b, c])
    assert gi.rows_copied == 5
    _check(gi, [c, b])                                   # rows move: a finished, c takes row 0; row 1 unchanged
    assert gi.rows_copied == 6
    _check(gi, [b])                                      # and b moves to row 0
    assert gi.inputs[4, 1:].eq(0).all() and gi.inputs[2, 1:].eq(SCRATCH).all()   # the rest: padding
