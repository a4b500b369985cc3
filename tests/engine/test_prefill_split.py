"""tools/prefill_split.py: a prefill's time split into attention and the rest, per policy, on the real engine."""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import engine.ops.attention as ops  # noqa: E402
from engine.sparse.policy import SparsePrefillPolicy  # noqa: E402
from engine.sparse.xattention import XAttentionPolicy  # noqa: E402


def test_the_split_adds_up_and_names_the_sparse_policys_share(capsys):
    import prefill_split
    before = ops.causal_attention, SparsePrefillPolicy.prefill_attention, XAttentionPolicy.estimate
    assert prefill_split.main(["--length", "1024", "--repeats", "1", "--policies",
                               "full,xattention:min_len=512:cpu_dense_above=1"]) == 0
    after = ops.causal_attention, SparsePrefillPolicy.prefill_attention, XAttentionPolicy.estimate
    assert after == before                                                 # nothing left wrapped
    out = capsys.readouterr().out
    rows = {m[0]: tuple(float(x) for x in m[1:4]) for m in
            re.findall(r"^  (\S+): ([\d.]+) = ([\d.]+) \+ ([\d.]+)", out, re.M)}
    assert set(rows) == {"full", "xattention:min_len=512:cpu_dense_above=1"}
    for total, attention, rest in rows.values():
        assert attention > 0 and rest > 0 and abs(total - attention - rest) <= 0.015   # printed to 2 decimals
    density = float(re.search(r"density ([\d.]+)", out)[1])
    assert 0 < density < 1                                             # the sparse path ran
    estimates = re.findall(r"^  (\S+): .*estimate ([\d.]+) \(([\d.]+)% of the prefill\)", out, re.M)
    assert [e[0] for e in estimates] == ["xattention:min_len=512:cpu_dense_above=1"]   # Full estimates nothing
    est, share = float(estimates[0][1]), float(estimates[0][2])
    total, attention, _ = rows[estimates[0][0]]
    assert 0 < est <= attention and abs(share / 100 - est / total) < 0.01     # inside its attention, its share
    assert "of this attention's time" in out and "of dense; with no attention at all" in out
