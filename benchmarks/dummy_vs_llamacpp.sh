#!/usr/bin/env bash
# Issue 43: tinyvllm vs llama.cpp on random GGUFs of published models' shapes, same file, same sitting.
#
#   LLAMA=/path/to/llama.cpp/build/bin benchmarks/dummy_vs_llamacpp.sh [SHAPE ...]
#
# SHAPE: qwen3-0.6b gemma-3-1b qwen3-moe-small (default: all three). Per shape:
#   1. `python -m tinyvllm.model.dummy $DIR/<shape>-$QTYPE.gguf --shape <shape> --gguf $QTYPE` (once; random
#      weights, llama.cpp's tensor names, SmolLM2's tokenizer padded to the real vocabulary);
#   2. benchmarks/side_by_side.py A/B/A, one server at a time: tinyvllm `--quantization gguf`, llama-server
#      (`-t 2 -np 16 --cont-batching`), tinyvllm again; one stream ($C1 requests) and concurrency 16
#      ($C16 requests), random token-id prompts of $IN tokens, $OUT output tokens, ignore_eos.
# The first tinyvllm start of a file converts and repacks it (minutes); its figures are measured after.
# Results: $RESULTS/<shape>/side_by_side.md and results.json; $RESULTS/sitting.txt: date, CPU, commit, peer
# version, settings, and the load average before and after each shape. Peers are not dependencies of tinyvllm.
set -euo pipefail
ROOT=${ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PY:-$ROOT/.venv/bin/python}
LLAMA=${LLAMA:?set LLAMA to llama.cpp\'s build/bin}
DIR=${DIR:-$ROOT/bench_results/dummy-gguf}
RESULTS=${RESULTS:-$ROOT/bench_results/dummy-vs-llamacpp-$(date +%Y%m%d-%H%M%S)}
QTYPE=${QTYPE:-Q8_0}
PORT=${PORT:-8900}
C1=${C1:-4}
C16=${C16:-16}
IN=${IN:-256}
OUT=${OUT:-128}
CTX=${CTX:-8192}  # llama-server's context, shared by its 16 slots (512 tokens each)
mkdir -p "$DIR" "$RESULTS"
{ echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"; { lscpu | grep 'Model name' || true; }; echo "cores: $(nproc)"
  echo "tinyvllm: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
  echo "llama-server: $("$LLAMA/llama-server" --version 2>&1 | grep -m1 version)"
  echo "settings: QTYPE=$QTYPE C1=$C1 C16=$C16 IN=$IN OUT=$OUT CTX=$CTX DIR=$DIR"; } > "$RESULTS/sitting.txt"
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(qwen3-0.6b gemma-3-1b qwen3-moe-small)
for shape in "${shapes[@]}"; do
  echo "$shape start $(date -u +%H:%M:%S) load$(uptime | sed 's/.*load average//')" >> "$RESULTS/sitting.txt"
  f=$DIR/$shape-${QTYPE,,}.gguf
  [ -f "$f" ] || PYTHONPATH=$ROOT "$PY" -m tinyvllm.model.dummy "$f" --shape "$shape" --gguf "$QTYPE"
  mml=1024
  tv="TINYVLLM_ENGINE_START_TIMEOUT=3600 PYTHONPATH=$ROOT $PY -m tinyvllm.entrypoints.cli serve --model $f --quantization gguf --port $PORT --served-model-name dummy --max-model-len $mml"
  lc="$LLAMA/llama-server -m $f -a dummy --port $((PORT + 1)) -t 2 -np 16 --cont-batching -c $CTX"
  PY=$PY "$PY" "$ROOT/benchmarks/side_by_side.py" --model dummy --out "$RESULTS/$shape" --no-prefix \
    --c1-prompts "$C1" --c16-prompts "$C16" --input-len "$IN" --output-len "$OUT" --start-timeout 1800 \
    --server tinyvllm "http://127.0.0.1:$PORT" "$tv" \
    --server llamacpp "http://127.0.0.1:$((PORT + 1))" "$lc" \
    --server tinyvllm-2 "http://127.0.0.1:$PORT" "$tv"
  echo "$shape end   $(date -u +%H:%M:%S) load$(uptime | sed 's/.*load average//')" >> "$RESULTS/sitting.txt"
done
