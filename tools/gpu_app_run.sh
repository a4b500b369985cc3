#!/usr/bin/env bash
# The app over a CUDA engine, run the way a GPU user runs it, with the figures issue 17 asks for.
#
#   bash tools/gpu_app_run.sh OUTDIR
#
# On the GPU machine: first stash and unpack ../shared/gpu-kit (its README; it brings Qt, its libraries, a font and
# the default model), then run this from the project root. On a CUDA workstation with the project installed it runs
# as it is. It prints: the default model's conversion, the first turn of a fresh process per mode (CLI: time to
# first token, decode tok/s), then the real window offscreen answering in gpu, layerwise (full and Quest) and gpu +
# MInference with a screenshot of each, then tests/gpu/test_window_gpu.py (every mode with every policy it runs), then
# the app's cost to the engine per mode and with Quest (tools/app_overhead.py),
# then the app's engine process alone against the CLI's, pinned to one CPU (tools/engine_process_cost.py).
set -uo pipefail
out=${1:-gpu-run}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 QT_QPA_PLATFORM=${QT_QPA_PLATFORM:-offscreen}
py=${PYTHON:-python3}
$py -c "import torch; print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
$py -c "from engine.defaults import ensure_default_model; print('default model:', ensure_default_model())" 2>&1 | tail -1
echo "== the first turn of a fresh process (CLI, the sample document, 64 tokens), twice per mode"
for mode in gpu layerwise chunked; do
  for run in 1 2; do
    $py main.py chat --mode "$mode" --max-new-tokens 64 --no-kv-store --json 2>/dev/null | $py -c "
import json, sys; d = json.load(sys.stdin)
print(f'$mode, process $run: time to first token {d[\"ttft_s\"]:.2f} s, decode {d[\"decode_tok_s\"]:.1f} tok/s')"
  done
done
echo "== the window (its engine in a process of its own, as python main.py runs it): four turns with screenshots"
timeout 600 $py -m app.screenshots "$out" --max-new-tokens 64 --timeout 180 2>&1 | tail -12
echo "app.screenshots exit: $?"
echo "== the same path as a test: a turn in each mode with each policy, switched from the panel (tests/gpu/test_window_gpu.py)"
timeout 600 $py -m pytest -q -m gpu tests/gpu/test_window_gpu.py -p no:cacheprovider 2>&1 | tail -3
# Rounds for APP_COST_MINUTES (default 4) per setting: the offload modes' turns on a GPU host spread widely, and ~90
# rounds told the app's cost there to a few percent where 8-16 could not (docs/benchmarks.md, "Many rounds").
minutes=${APP_COST_MINUTES:-4}
pin=$([ "$(nproc)" -ge 6 ] && echo "--pin 3,4")      # the engine processes on two CPUs, the window on the others
echo "== the app's cost to the engine (medians of interleaved rounds for $minutes min; decode, time to first token, the GUI's refresh)"
for mode in gpu layerwise chunked; do
  echo "-- $mode"; $py tools/app_overhead.py --runs 1000 --minutes "$minutes" --tokens 64 --mode "$mode" $pin \
    --control 2>&1 | grep -E "^engine in|^time to first|Watch the engine off|paired|^control"
done
echo "-- layerwise, Quest (budget 1024, sparse from 1024 tokens: the sample runs sparse; each step carries its picks)"
$py tools/app_overhead.py --runs 1000 --minutes "$minutes" --tokens 64 --mode layerwise $pin --control \
  --policy quest:min_context=1024:min_layer_mb=0:token_budget=1024 2>&1 | grep -E "^engine in|^time to first|Watch the engine off|paired|^control"
echo "== the app's engine process (watched, unwatched) against the CLI's engine, no window, pinned to CPU 3"
for mode in layerwise chunked; do
  timeout 400 $py tools/engine_process_cost.py --mode "$mode" --rounds 8 --pin 3 2>&1 | tail -4
done
