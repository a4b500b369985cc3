"""Pages, keys and helpers shared by the KV page store's tests (test_storage.py, test_storage_writer.py)."""
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import xxhash

from engine.offload.storage import KVStore, PageFormat

LAYOUT = (2, 2, 1, 4, 8)  # L, 2, Hkv, page_size, D
FMT = PageFormat("tiny-model", "float32", LAYOUT)
REPO = Path(__file__).resolve().parents[2]


def page(i: int) -> torch.Tensor:
    """A float32 page whose values depend on i."""
    return torch.randn(LAYOUT, generator=torch.Generator().manual_seed(i))


def key(i: int) -> str:
    return xxhash.xxh3_128_hexdigest(f"page {i}".encode())


def page_files(root: Path, suffix: str = ".kvp") -> list[Path]:
    return sorted(root.rglob(f"*{suffix}"))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@functools.cache
def page_file_size() -> int:
    """Bytes of one page file of FMT (header + payload), measured by writing one."""
    with tempfile.TemporaryDirectory() as d:
        store = KVStore(d, FMT, 1 << 20)
        assert store.write(key(0), page(0))
        return store.usage()[1]


BIG_LAYOUT = (16, 2, 4, 64, 64)  # 2 MiB of float32 per page: a write takes long enough to be caught midway


def run_python(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env)
