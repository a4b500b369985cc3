"""What the masks view (widgets/mask_view.py) says in words about a prefill's masks (widgets/mask_pattern.py): the
caption of the mask shown, and the hover text of a mask cell and of a cell of the layers × heads density grid.
Plain strings; no Qt."""
from __future__ import annotations

import numpy as np

from widgets.mask_pattern import MEAN_HEADS, MINFERENCE, NAMES, PrefillMasks


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def caption(p: PrefillMasks, layer: int, head: int, dense: str | dict | None, newest: bool) -> str:
    """The caption of one layer's mask, of one head or the mean of the heads (MEAN_HEADS). `dense`: why the last
    prefill ran dense (MaskView.set_dense_reasons); its dense layers are named when p is that prefill (`newest`)."""
    ms = p.heads(layer, head)
    who = f"mean of {len(ms)} heads" if head == MEAN_HEADS else f"head {head}"
    if not ms:
        return f"{NAMES[p.kind]} · prefill step {p.step} · layer {layer} · {who}: not recorded"
    density = float(np.mean([m.density for m in ms]))
    text = (f"{NAMES[p.kind]} · prefill step {p.step} · layer {layer} · {who} · {p.n:,} tokens · "
            f"density {_pct(density)}")
    if p.offset:
        text += f" · queries from {p.offset:,} (the first {p.offset:,} tokens came from the prefix cache)"
    if p.kind == MINFERENCE:
        text += (f" · {_span([len(m.vertical) for m in ms])} verticals, {_span([len(m.slash) for m in ms])} "
                 "slashes" + (" per head" if len(ms) > 1 else ""))
    if isinstance(dense, str):
        text += f" · from an earlier prefill: the last one ran dense ({dense})"
    elif dense and newest:
        layers = sorted(int(l) for l in dense)
        text += (f" · layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} ran dense: "
                 + "; ".join(sorted(set(dense.values()))))
    return text


def cell_text(p: PrefillMasks, layer: int, head: int, edges: np.ndarray, fractions: np.ndarray,
              x: float, y: float) -> str:
    """What the mask cell under (key x, query y) holds, both inside the mask: its token ranges (bins `edges`) and
    its share of computed pairs (`fractions`)."""
    e = edges
    i, j = (int(np.searchsorted(e, v, side="right")) - 1 for v in (y, x))
    r0, r1, c0, c1 = e[i], e[i + 1] - 1, e[j], e[j + 1] - 1
    lines = [f"queries {r0:,}-{r1:,} · keys {c0:,}-{c1:,}"]
    if c0 > r1:
        lines.append("above the diagonal: a query never sees later keys")
    elif r1 < p.offset:
        lines.append("prefix cache: these queries were not computed in this prefill")
    else:
        lines.append(f"{_pct(fractions[i, j])} of the cell's causal pairs computed")
        ms = p.heads(layer, head)
        if p.kind == MINFERENCE and head != MEAN_HEADS and ms:
            m = ms[0]
            v = np.asarray(m.vertical).ravel()
            d = np.asarray(m.slash).ravel()
            nv = int(((v >= c0) & (v <= c1)).sum())
            ns = int(((d >= max(0, r0 - c1)) & (d <= r1 - c0)).sum())
            lines.append(f"{nv} vertical columns, {ns} slash diagonals cross it")
    return "\n".join(lines)


def grid_cell_text(p: PrefillMasks, layer: int, head: int) -> str:
    """The density grid's cell of (layer, head): its recorded density ("" where that head was not recorded)."""
    if (layer, head) not in p.masks:
        return ""
    return f"layer {layer} · head {head} · density {_pct(p.masks[(layer, head)].density)}"
