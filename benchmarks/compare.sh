#!/usr/bin/env bash
# Run the same workloads against several OpenAI-compatible servers already running on this
# machine and write one comparison table.
#
#   benchmarks/compare.sh NAME=URL [NAME=URL ...]
#   e.g. benchmarks/compare.sh tinyvllm=http://127.0.0.1:8000 vllm=http://127.0.0.1:8001 llamacpp=http://127.0.0.1:8002
#
# Environment: MODEL (served model name, default SmolLM2-135M-Instruct; may be NAME:MODEL per server
# via MODEL_<NAME>), OUT (results folder, default bench_results/compare-<date>), NUM_PROMPTS (64),
# INPUT_LEN (256), OUTPUT_LEN (128), CONCURRENCY ("1 16").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench_results/compare-$(date +%Y%m%d-%H%M%S)}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
CONCURRENCY=${CONCURRENCY:-"1 16"}
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: $0 NAME=URL [NAME=URL ...]" >&2; exit 2; }
for spec in "$@"; do
  name=${spec%%=*}; url=${spec#*=}
  var="MODEL_${name}"; model=${!var:-${MODEL:-SmolLM2-135M-Instruct}}
  for c in $CONCURRENCY; do
    n=$NUM_PROMPTS; [ "$c" = 1 ] && n=$(( NUM_PROMPTS < 8 ? NUM_PROMPTS : 8 ))
    echo "== $name: random ${INPUT_LEN}/${OUTPUT_LEN}, concurrency $c, $n prompts"
    "$PY" -m tinyvllm.benchmarks.serve --base-url "$url" --model "$model" --dataset random \
      --prompt-format token-ids --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts "$n" \
      --max-concurrency "$c" --label "$name" --result-file "$OUT/$name-random-c$c.json" --no-plot --disable-tqdm
  done
  echo "== $name: shared prefix (1024-token prefix + 64 new prompt tokens, 64 output tokens)"
  "$PY" -m tinyvllm.benchmarks.serve --base-url "$url" --model "$model" --dataset shared-prefix \
    --prefix-len 1024 --suffix-len 64 --output-len 64 --num-groups 1 --num-prompts 8 --max-concurrency 1 \
    --label "$name" --result-file "$OUT/$name-shared-prefix.json" --no-plot --disable-tqdm
done
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    m = r.get("metrics", r)
    rows.append((f.stem, m.get("output_throughput", float("nan")), m.get("median_ttft_ms", float("nan")),
                 m.get("median_tpot_ms", float("nan")), m.get("errors", 0)))
lines = ["| run | output tok/s | median TTFT ms | median TPOT ms | errors |", "|---|---|---|---|---|"]
lines += [f"| {a} | {b:.1f} | {c:.1f} | {d:.2f} | {e} |" for a, b, c, d, e in rows]
table = "\n".join(lines)
(out / "comparison.md").write_text(table + "\n")
print(table)
PYEOF
