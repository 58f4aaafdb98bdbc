#!/usr/bin/env bash
# Native GGUF (issue 17) against the dequantized bf16 path and llama.cpp, on the SAME GGUF file, -t 2.
#   LLAMA=/path/to/llama.cpp/build/bin benchmarks/gguf_native.sh [GGUF] [OUT]
# GGUF: default the embedded SmolLM2 Q4_1 file. Alternates A/B/A for the in-process decode step.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GGUF=${1:-$($PY -c "from tinyvllm.model.loader import _find_alias_gguf as f; print(f('SmolLM2-135M-Instruct'))")}
OUT=${2:-bench_results/gguf-native-$(date +%Y%m%d-%H%M%S)}
LLAMA=${LLAMA:-/work/peers/llama.cpp/build/bin}
mkdir -p "$OUT"
echo "GGUF: $GGUF" | tee "$OUT/info.txt"
lat() { $PY -m tinyvllm.entrypoints.cli bench latency --model "$GGUF" --quantization "$1" --input-len 128 \
          --output-len 64 --num-iters 2 2>&1 | grep -A1 "step ms" | tail -1 | sed "s/^/$1 /"; }
bench_llama() { "$LLAMA/llama-bench" -m "$GGUF" -p 0 -n 64 -t 2 -r 2 -o md 2>/dev/null | grep tg64 | sed 's/^/llama.cpp /'; }
{
  echo "## in-process decode step, batch 1 (bench latency 128 in / 64 out; llama-bench tg64, t/s)"
  lat gguf; lat none; bench_llama; lat gguf; lat none; bench_llama
} | tee "$OUT/latency.txt"
if [ "${THROUGHPUT:-1}" = 1 ]; then
  {
    echo "## offline throughput 64 x 256 / 128"
    for q in gguf none; do
      $PY -m tinyvllm.entrypoints.cli bench throughput --model "$GGUF" --quantization $q 2>&1 | tail -2 | sed "s/^/$q /"
    done
  } | tee "$OUT/throughput.txt"
fi
if [ "${HTTP:-1}" = 1 ]; then
  $PY benchmarks/side_by_side.py --out "$OUT/http" \
    --server native http://127.0.0.1:8010 "$PY -m tinyvllm.entrypoints.cli serve --model $GGUF --served-model-name SmolLM2-135M-Instruct --port 8010 --quantization gguf" \
    --server bf16 http://127.0.0.1:8011 "$PY -m tinyvllm.entrypoints.cli serve --model $GGUF --served-model-name SmolLM2-135M-Instruct --port 8011 --quantization none" \
    --server llamacpp http://127.0.0.1:8012 "$LLAMA/llama-server -m $GGUF -a SmolLM2-135M-Instruct --port 8012 -t 2 -c 32768 -np 16 --cont-batching"
fi
