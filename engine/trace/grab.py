"""What the recorder keeps of the arrays it is handed: a copy safe from later in-place changes (CUDA tensors copied to
the host asynchronously, read after the step's end), then numpy when the step closes."""
from __future__ import annotations

import numpy as np

from engine.trace.events import MaskSummary


def masks_of(entry) -> list[MaskSummary]:
    """A layer's recorded masks (mask_summaries' tuple) as a MaskSummary per head, numpy."""
    layer, vertical, slash, n, density, images = entry
    density = to_numpy(density).astype(float)
    none = np.zeros(0, dtype=np.int32)
    vertical, slash = (none[None].repeat(len(density), 0) if x is None else to_numpy(x) for x in (vertical, slash))
    images = [None] * len(density) if images is None else to_numpy(images)
    return [MaskSummary(layer, h, vertical[h], slash[h], n, float(d), images[h]) for h, d in enumerate(density)]


def grab(x, async_ok: bool):
    """Keep an array-like safe from later in-place changes: numpy is copied, a torch tensor cloned to the host
    (asynchronously from CUDA when `async_ok`, i.e. end_step's sync comes before it is read)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if hasattr(x, "detach") and hasattr(x, "device"):
        t = x.detach()
        return t.to("cpu", non_blocking=async_ok) if t.device.type != "cpu" else t.clone()
    return np.asarray(x)


def to_numpy(x, dtype=None) -> np.ndarray:
    """A grabbed array as numpy (`dtype`: narrowed to it, e.g. page ids to int32)."""
    if not isinstance(x, np.ndarray):
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return x if dtype is None else x.astype(dtype, copy=False)
