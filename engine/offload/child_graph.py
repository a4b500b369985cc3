"""Put a recorded CUDA graph into a stream capture in progress, as one child-graph node.

A whole layerwise decode step is recorded by stream capture (engine/offload/step_graphs.py). Each layer's compute
in it was recorded before as its own graph (engine/offload/decode_graphs.py); torch cannot replay a graph inside a
capture, so the step's capture ran every layer's body from Python again: ~1.6 ms of launches a layer, ~50 ms a
step on the H200 machine's host. CUDA can instead add the layer's graph to the capture as one node: read the
capture's graph and its current dependencies (`cuStreamGetCaptureInfo`), add a child-graph node after them
(`cuGraphAddChildGraphNode`, which copies the child graph), and make that node the capture's dependency
(`cuStreamUpdateCaptureDependencies`), so the work captured next follows it. The driver API through ctypes: torch
exposes none of the three, and the driver (libcuda) is there wherever CUDA runs. The v2 entry points are the ones
every driver since CUDA 11.3 exports (later ones add edge data, which nothing here uses).

The child graph must be kept (`torch.cuda.CUDAGraph(keep_graph=True)`, torch >= 2.8) and must not allocate
memory inside the graph (torch's graphs never do: their memory comes from a pool). The node reads and writes the
same addresses as the child's own replays, so the child graph's pool has to outlive the step graph (DecodeGraphs
keeps its graphs as long as it lives).
"""
from __future__ import annotations

import ctypes

import torch

_ACTIVE = 1        # CU_STREAM_CAPTURE_STATUS_ACTIVE
_SET = 1           # CU_STREAM_SET_CAPTURE_DEPENDENCIES
_lib = None


def supported() -> bool:
    """torch keeps a captured graph's cudaGraph_t on request (keep_graph, torch >= 2.8) and the driver has the three
    entry points (else a step's capture runs the layers' bodies from Python, as before)."""
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
        return False
    try:
        _driver()
    except (OSError, AttributeError):
        return False
    return True


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        p, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (("cuStreamGetCaptureInfo_v2", [p, ctypes.POINTER(ctypes.c_int),
                                                          ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(p),
                                                          ctypes.POINTER(ctypes.POINTER(p)), ctypes.POINTER(sz)]),
                           ("cuGraphAddChildGraphNode", [ctypes.POINTER(p), p, ctypes.POINTER(p), sz, p]),
                           ("cuStreamUpdateCaptureDependencies", [p, ctypes.POINTER(p), sz, ctypes.c_uint]),
                           ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


def _check(lib, rc: int, what: str) -> None:
    if rc:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


def add_child(graph: torch.cuda.CUDAGraph) -> None:
    """Append `graph` (captured with keep_graph=True) to the capture running on the current stream as one node
    after everything captured on it so far."""
    lib = _driver()
    s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    status, cid, parent = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    deps, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
    _check(lib, lib.cuStreamGetCaptureInfo_v2(s, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(parent),
                                              ctypes.byref(deps), ctypes.byref(n)), "reading the capture")
    if status.value != _ACTIVE:
        raise RuntimeError("add_child: the stream is not capturing")
    node = ctypes.c_void_p()
    _check(lib, lib.cuGraphAddChildGraphNode(ctypes.byref(node), parent, deps, n,
                                             ctypes.c_void_p(graph.raw_cuda_graph())), "adding a child graph")
    _check(lib, lib.cuStreamUpdateCaptureDependencies(s, ctypes.byref(node), 1, _SET), "updating the capture")
