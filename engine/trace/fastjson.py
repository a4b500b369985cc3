"""Compact JSON as bytes, fast: orjson where it is installed, the standard library's json otherwise.

A recording's write is mostly JSON encoding (the Chrome trace and the steps: ~5,000 objects for a 64-token turn),
and the standard encoder takes ~10x orjson's time for it (measured on a 64-token gpu-mode turn on this project's
2-core CPU: 16 ms against 1.7 ms). Both write the same values; orjson writes non-ASCII text as UTF-8 (json
escapes it) and a float that is not finite as null (json writes NaN, which is not JSON).
"""
from __future__ import annotations

import json

try:
    import orjson
except ImportError:          # (an install without it, e.g. a GPU machine that cannot fetch packages)
    orjson = None

_OPTIONS = 0 if orjson is None else orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def dumps(obj, default=None) -> bytes:
    """`obj` as compact JSON bytes; `default(v)` turns a value neither encoder knows into one it does (numpy
    arrays and scalars are known to orjson)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, default=default, option=_OPTIONS)
        except TypeError:    # (orjson.JSONEncodeError: e.g. an integer wider than 64 bits): the standard encoder
            pass
    return json.dumps(obj, default=default, separators=(",", ":")).encode()
