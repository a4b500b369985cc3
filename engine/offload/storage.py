"""Local-disk KV page store: full KV pages kept across requests and restarts, so a prompt whose prefix was seen
before loads that prefix's KV from disk instead of recomputing its prefill.

A page is the KV of one full block across all layers, one tensor of shape (L, 2, Hkv, page_size, D). Keys chain
like the prefix cache's block hashes: key_i = xxh3_128(key_{i-1}, token ids of page i), starting from the
format's namespace (a digest of model id, dtype and layout), so equal prefixes share keys and pages of another
model, dtype or layout never match.

A page file, root/<namespace[:16]>/<key[:2]>/<key>.kvp, is magic + length-prefixed JSON header (format, key,
payload checksum) padded to put the payload 64-byte aligned + the raw payload. It appears only by atomic rename
of a complete, fsynced temporary file, so a crash leaves no page or a whole one. A read verifies header and
checksum before it touches its output and deletes a file that fails (it is written again later).

The size limit covers the whole store (all namespaces): after each write the least recently accessed pages go.
Access time = file mtime (refreshed by each read); in memory an OrderedDict in access order. Other processes may
share the store (two app instances): after each 1/16 of the limit written, the index learns the pages they wrote
and forgets those they deleted, so the limit holds for all together. I/O problems never raise: an unusable root
disables the store at open, a failed write (disk full, ...) stops writing for the rest of the run; each warns
once. Pages are written on a background thread by StoreWriter (engine/offload/store_writer.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import tempfile
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import xxhash

MAGIC = b"KVSPAGE1"
_HEAD = len(MAGIC) + 4   # magic + little-endian uint32 header length
_ALIGN = 64              # payload offset: any dtype can be viewed in place
_PAGE, _TMP = ".kvp", ".tmp"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def default_store_dir() -> Path:
    """The KV store's folder: $KVSCOPE_KV_STORE, else kvscope/kv in the platform's user cache directory (next to
    the converted default model)."""
    from engine.defaults import cache_root
    return Path(os.environ["KVSCOPE_KV_STORE"]) if os.environ.get("KVSCOPE_KV_STORE") else cache_root() / "kv"


@dataclass(frozen=True)
class PageFormat:
    model_id: str            # identity of the weights
    dtype: str               # "float32" / "bfloat16" / "float16"
    layout: tuple[int, ...]  # one page: (L, 2, Hkv, page_size, D)

    def __post_init__(self):
        object.__setattr__(self, "layout", tuple(int(n) for n in self.layout))
        if self.dtype not in _DTYPES or len(self.layout) != 5 or min(self.layout) < 1:
            raise ValueError(f"page format {self.dtype!r} {self.layout}: the dtype must be one of "
                             f"{', '.join(_DTYPES)} and the layout (L, 2, Hkv, page_size, D) with sizes >= 1")

    @property
    def page_size(self) -> int:
        return self.layout[3]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.layout) * self.torch_dtype.itemsize

    @cached_property
    def namespace(self) -> str:
        ident = json.dumps(["kvscope-kv-1", self.model_id, self.dtype, list(self.layout)])
        return xxhash.xxh3_128_hexdigest(ident.encode())


def chain_keys(token_ids: Sequence[int], fmt: PageFormat, prefix_key: str | None = None) -> list[str]:
    """Keys of the full pages of token_ids; prefix_key (the key of the page before them) continues a chain."""
    ids = np.asarray(token_ids, dtype="<i8")
    prev = fmt.namespace if prefix_key is None else prefix_key
    keys = []
    for start in range(0, len(ids) - fmt.page_size + 1, fmt.page_size):
        h = xxhash.xxh3_128(bytes.fromhex(prev))
        h.update(ids[start:start + fmt.page_size].tobytes())
        prev = h.hexdigest()
        keys.append(prev)
    return keys


def _leftover(tmp_name: str) -> bool:
    """A temporary file (<key>.<pid>.<random>.tmp) whose writing process is gone."""
    pid = tmp_name.split(".")[1]
    if not pid.isdigit() or sys.platform == "win32":  # Windows: no cheap probe; an open file is not deleted
        return True
    if int(pid) == os.getpid():
        return False  # this process's writer may be busy with it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by another user
        pass
    return False


def _host_bytes(page: torch.Tensor) -> np.ndarray:
    """The page's bytes, contiguous, in host memory. A CPU page is copied by numpy, on the calling thread alone: a
    torch copy on a thread other than the engine's (the store's writer) starts an OpenMP team of its own there, and
    on a 2-core CPU the engine then decoded 1.5x slower for as long as that thread lived (default model: the first
    answer about a new document at 79-84 ms a token against 52-54)."""
    page = page.detach()
    if page.is_cuda:
        return page.contiguous().cpu().view(torch.uint8).numpy().reshape(-1)
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[page.element_size()]   # (bf16: no numpy)
    return np.ascontiguousarray(page.view(same).numpy()).view(np.uint8).reshape(-1)


def _fsync_dir(folder: str) -> None:
    """Make a rename durable (POSIX only; best effort: some file systems refuse it)."""
    if os.name == "posix":
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class KVStore:
    def __init__(self, root: Path | str, fmt: PageFormat, limit_bytes: int):
        self.root, self.fmt, self.limit_bytes = Path(root), fmt, int(limit_bytes)
        self.dir = self.root / fmt.namespace[:16]
        self.enabled = False
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # page path -> file size, least recently used first
        self._bytes = self._unlearned = 0                    # _unlearned: bytes written since the disk was listed
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.root))
        except OSError as e:
            warnings.warn(f"KV page store: cannot use {self.root} ({e}); KV pages are not stored on disk in this "
                          "run", stacklevel=2)
            return
        self.enabled = True
        self._learn()  # every page file in the store, oldest access first (the limit may have been lowered)

    def _listing(self) -> list[tuple[int, str, int]]:
        """(mtime, path, size) of every page file, oldest first; dead writers' leftovers are deleted."""
        pages = []
        for path in self.root.glob("*/*/*"):
            with contextlib.suppress(OSError):
                if path.name.endswith(_PAGE):
                    st = path.stat()
                    pages.append((st.st_mtime_ns, str(path), st.st_size))
                elif path.name.endswith(_TMP) and _leftover(path.name):
                    path.unlink()  # from a process killed mid-write
        return sorted(pages)

    def _learn(self) -> None:
        """Sync the index with the disk, where other processes write and evict too: pages not in it are added as
        the most recently used (written since the last listing, or all of them at open), pages gone are dropped;
        then the least recently used go until the store fits its limit."""
        listing = self._listing()
        on_disk = {path for _, path, _ in listing}
        with self._lock:
            for path in [p for p in self._index if p not in on_disk and not os.path.exists(p)]:
                self._bytes -= self._index.pop(path)
            for _, path, size in listing:
                if path not in self._index:
                    self._index[path] = size
                    self._bytes += size
            self._unlearned = 0
            self._evict()

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + _PAGE)

    def _evict(self) -> None:
        """Delete least recently accessed pages until the store fits its limit (lock held)."""
        while self._bytes > self.limit_bytes and self._index:
            path, size = self._index.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _header(self, key: str, checksum: str) -> bytes:
        fmt = self.fmt
        head = json.dumps({"model_id": fmt.model_id, "dtype": fmt.dtype, "layout": list(fmt.layout),
                           "tokens": fmt.page_size, "key": key, "nbytes": fmt.nbytes, "checksum": checksum})
        body = head.encode()
        body += b" " * (-(_HEAD + len(body)) % _ALIGN)  # JSON allows trailing whitespace
        return MAGIC + len(body).to_bytes(4, "little") + body

    def _check(self, t: torch.Tensor, what: str) -> None:
        if tuple(t.shape) != self.fmt.layout or t.dtype != self.fmt.torch_dtype:
            raise ValueError(f"{what} is {tuple(t.shape)} {t.dtype}; pages are {self.fmt.layout} {self.fmt.dtype}")

    def _load(self, path: str, key: str) -> np.ndarray | None:
        """A page file's verified bytes; None when it is missing or bad (a bad file is deleted)."""
        try:
            with open(path, "rb") as f:
                buf = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
                start = len(buf) - self.fmt.nbytes if f.readinto(memoryview(buf)) == len(buf) else -1
        except FileNotFoundError:
            return None
        except OSError:
            start = -1
        try:  # the header must be exactly the one this format writes for this key, with the payload's checksum
            checksum = json.loads(buf[_HEAD:start].tobytes())["checksum"] if start > _HEAD else ""
        except (ValueError, TypeError, KeyError):  # ValueError: bad JSON or UTF-8
            checksum = ""
        if checksum and buf[:start].tobytes() == self._header(key, checksum) \
                and xxhash.xxh3_64_hexdigest(buf[start:]) == checksum:
            return buf
        with contextlib.suppress(OSError):
            os.unlink(path)  # truncated, corrupt or another format's: never used, rewritten later
        return None

    def contains(self, key: str) -> bool:
        """A page file exists for key in this format's namespace (not verified: read() does that)."""
        path = self._path(key)
        with self._lock:
            if path in self._index:
                return True
        return os.path.isfile(path)

    def fetch(self, key: str) -> torch.Tensor | None:
        """The page as a CPU tensor, verified; None when it is missing or bad (a bad file is deleted). Marks the
        page used. Safe to call from several threads at once (reads in parallel reach the disk's bandwidth)."""
        path = self._path(key)
        buf = self._load(path, key)
        if buf is None:
            with self._lock:
                self._bytes -= self._index.pop(path, 0)
            return None
        with contextlib.suppress(OSError):  # fails only when evicted meanwhile; the data is still good
            os.utime(path)  # the access time that orders eviction, also after a restart
            with self._lock:  # now the most recently used (also a page another process wrote)
                self._bytes += len(buf) - self._index.pop(path, 0)
                self._index[path] = len(buf)
        return torch.from_numpy(buf[-self.fmt.nbytes:]).view(self.fmt.torch_dtype).view(self.fmt.layout)

    def read(self, key: str, out: torch.Tensor) -> bool:
        """Fill out (any device, any strides) with the page; False, out untouched, when it is missing or bad."""
        self._check(out, "read target")
        page = self.fetch(key)
        if page is None:
            return False
        out.copy_(page)
        return True

    def write(self, key: str, page: torch.Tensor) -> bool:
        """Store one page (any device, any strides); True when it is on disk (written now or before)."""
        if not self.enabled:
            return False
        self._check(page, "page")
        if self.contains(key):
            return True
        payload = _host_bytes(page)
        header = self._header(key, xxhash.xxh3_64_hexdigest(payload))
        size = len(header) + len(payload)
        if size > self.limit_bytes:
            return False
        path, tmp = self._path(key), None
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f"{key}.{os.getpid()}.", suffix=_TMP, dir=folder)
            with open(fd, "wb") as f:
                f.write(header)
                f.write(memoryview(payload))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            _fsync_dir(folder)
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self.enabled = False  # so this warning comes once
            why = "the disk is full" if e.errno in _DISK_FULL else "a write failed"
            warnings.warn(f"KV page store: {why} in {folder} ({e}); storing KV pages on disk is off for the rest "
                          "of this run", stacklevel=2)
            return False
        with self._lock:
            self._bytes += size - self._index.pop(path, 0)
            self._index[path] = size
            self._unlearned += size
            learn = self._unlearned * 16 >= self.limit_bytes
            if not learn:
                self._evict()
        if learn:  # other processes may have written too
            self._learn()
        return True

    def usage(self) -> tuple[int, int]:
        """(pages, bytes) in the whole store."""
        with self._lock:
            return len(self._index), self._bytes

    def clear(self) -> int:
        """Delete every page of every namespace; the bytes freed."""
        freed = 0
        with self._lock:
            self._index.clear()
            self._bytes = 0
            for path in self.root.glob(f"*/*/*{_PAGE}"):
                with contextlib.suppress(OSError):
                    size = path.stat().st_size
                    path.unlink()
                    freed += size
        return freed

    def summary(self) -> list[dict]:
        """Per namespace folder: {"namespace", "pages", "bytes"}, for a "show" command."""
        with self._lock:
            items = list(self._index.items())
        pages: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for path, size in items:
            ns = Path(path).parts[-3]  # root/<namespace>/<key[:2]>/<key>.kvp
            pages[ns] += 1
            nbytes[ns] += size
        return [{"namespace": ns, "pages": pages[ns], "bytes": nbytes[ns]} for ns in sorted(pages)]

    def close(self) -> None:
        """Stop writing; reads still work."""
        self.enabled = False

