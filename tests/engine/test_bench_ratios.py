"""bench's ratios: the ratio of the medians, and the median of each repeat's own ratio (paired)."""
from bench.__main__ import _ratio, paired


def test_a_paired_ratio_follows_each_repeat_not_the_medians():
    # a host that drifts between repeats: in each one the variant is 1.5x its base
    base = [100.0, 60.0, 200.0]                       # tok/s
    variant = [150.0, 90.0, 300.0]
    assert _ratio(150.0, 100.0, "prefill 7000 (tok/s)") == "1.50x faster"
    assert paired(variant, base, "prefill 7000 (tok/s)") == " (paired 1.50x)"
    shuffled = [300.0, 150.0, 90.0]                   # the same values, other repeats: the medians alike, pairs not
    assert paired(shuffled, base, "prefill 7000 (tok/s)") == " (paired 2.50x)"   # 3.0, 2.5, 0.45
    # times (ms/token): lower is faster, so the ratio turns over
    assert paired([10.0, 20.0], [15.0, 30.0], "decode @7000 (ms/token)") == " (paired 1.50x)"


def test_no_paired_ratio_without_a_value_for_every_repeat():
    assert paired([1.0, 2.0], [1.0], "prefill (tok/s)") == ""
    assert paired([1.0], [1.0], "prefill (tok/s)") == ""        # one repeat: the plain ratio says it all
