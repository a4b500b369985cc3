#!/usr/bin/env bash
# Record a 25K-token Quest turn and the same turn with full attention on a GPU, for replay and compare elsewhere:
#   bash tools/record_32k.sh OUTDIR        (on the GPU machine: `source ../shared/gpu-kit/unpack.sh` first)
# The default model is stretched to 32K tokens (linear RoPE scaling x4, a copy in /tmp/smol32k); the document is a
# haystack with one fact in the middle (bench/needle.py). Each turn runs twice, with and without --record, so the
# recording's cost shows beside it. Then, anywhere: python main.py compare OUTDIR/quest32k.kvscope OUTDIR/full32k.kvscope
set -e
OUT=${1:?usage: bash tools/record_32k.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore
P=$(python -c "from engine.defaults import ensure_default_model; print(ensure_default_model())" | tail -1)
rm -rf /tmp/smol32k && cp -r "$P" /tmp/smol32k
python - <<'PY'
import json
p = "/tmp/smol32k/config.json"; c = json.load(open(p))
c["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}; c["max_position_embeddings"] = 32768
json.dump(c, open(p, "w"))
from bench.needle import NEEDLES, haystack
fact, _, _ = NEEDLES["number"]
hay = haystack(2900, 0)
open("/tmp/needle32k.txt", "w").write(" ".join(hay[:1450] + [fact] + hay[1450:]))
PY
chat() {
  python main.py chat --model /tmp/smol32k --document /tmp/needle32k.txt --mode layerwise --max-new-tokens 32 \
    --ask "What is the access code for the north gate of the observatory?" --max-model-len 32768 --no-kv-store \
    --json "$@"
}
for pol in quest:token_budget=2048:min_layer_mb=0 full; do
  name=${pol%%:*}
  chat --policy $pol --record "$OUT/${name}32k.kvscope" > /tmp/recorded.json
  chat --policy $pol 2>/dev/null > /tmp/plain.json
  python - "$name" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in ("/tmp/recorded.json", "/tmp/plain.json"))
print(f"{sys.argv[1]}: prompt {a['prompt_tokens']} tokens; with --record TTFT {a['ttft_s']:.3f} s, decode "
      f"{a['decode_tok_s']:.1f} tok/s; without TTFT {b['ttft_s']:.3f} s, decode {b['decode_tok_s']:.1f} tok/s; "
      f"answer {a['answer'][:60]!r}")
PY
done
ls -l "$OUT"
