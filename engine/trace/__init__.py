"""What the engine does, recorded exactly and cheaply: events, recorders, Perfetto export and summaries.

No Qt here, and torch is imported only by a `TraceRecorder` on a CUDA device.
"""
from engine.trace.chrome import (check_chrome_trace, read_chrome_trace, summarize_chrome_trace, to_chrome_trace,
                                 write_chrome_trace)
from engine.trace.events import (COMPUTE, COMPUTING, COPY_LANES, D2H, DECODE, FREE, H2D, HOST, LANES, LIVE_DETAIL_HZ,
                                 LOAD, LOADING, LOW_DETAIL_HZ, PHASES, PREFILL, READY, SLOT_STATES, TOKENIZE,
                                 MaskSummary, QuestPick, SlotState, Span, StepTrace, live_detail_hz)
from engine.trace.recorder import NULL_RECORDER, NULL_SPAN, Recorder, TraceRecorder
from engine.trace.summary import TraceSummary, summarize

__all__ = [
    "Span", "SlotState", "QuestPick", "MaskSummary", "StepTrace",
    "COMPUTE", "H2D", "D2H", "HOST", "LANES", "COPY_LANES",
    "FREE", "LOADING", "READY", "COMPUTING", "SLOT_STATES",
    "PREFILL", "DECODE", "LIVE_DETAIL_HZ", "LOW_DETAIL_HZ", "live_detail_hz", "LOAD", "TOKENIZE", "PHASES",
    "Recorder", "TraceRecorder", "NULL_RECORDER", "NULL_SPAN",
    "to_chrome_trace", "write_chrome_trace", "read_chrome_trace", "check_chrome_trace", "summarize_chrome_trace",
    "TraceSummary", "summarize",
]
