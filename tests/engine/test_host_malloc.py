"""engine/host_malloc.py: a CPU engine keeps freed tensors' memory for the next ones instead of mapping it afresh."""
import sys

import pytest
import torch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_engine_keeps_freed_tensor_memory_for_reuse(default_model_dir):
    """After a CPU LLM is built, a freed 96 MiB tensor's memory stays with the process (no munmap: the next tensor
    reuses it without page faults); glibc alone would have mapped it and given it back at once."""
    from engine import LLM, host_malloc
    LLM(str(default_model_dir), device="cpu", max_model_len=256).close()
    assert host_malloc.tune() is True                          # glibc took both thresholds (once, at the build)
    x = torch.ones(24 << 20)                                   # 96 MiB, touched: resident
    held = _rss_bytes()
    del x
    assert held - _rss_bytes() < 16 << 20                      # not given back
    y = torch.ones(24 << 20)                                   # the same memory again: no growth
    assert _rss_bytes() - held < 16 << 20
    del y
