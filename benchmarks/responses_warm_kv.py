"""Warm KV for ``previous_response_id`` (issue 40): how much of each turn's prompt the prefix cache (and, after a
restart, the disk KV offload tier) serves, for a conversation continued through the Responses API's store versus
the same conversation sent statelessly (the whole history each turn) to chat completions.

1. A ``tinyvllm serve`` with a disk tier (``--kv-offload-path``) and a store file.
2. An 8-turn ``previous_response_id`` chain over a ~2K-token system prompt (``instructions``), greedy, then the
   same 8 turns to ``/v1/chat/completions`` with the whole history each time (each run with its own
   ``cache_salt``, so neither warms the other).
3. Turn 1 of a fresh chain (and of a fresh chat), the server stopped and started again on the same tier and store
   files, then turn 2 (``previous_response_id`` / the whole history).

Prints a Markdown table per part and writes the JSON next to it.

    .venv/bin/python benchmarks/responses_warm_kv.py --out bench_results/responses_warm_kv
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["Hello! Who are you?", "What is rule 7 about?", "Summarise rule 12 in a few words.",
             "Which rule mentions the river?", "Name a fruit.", "What is 3 + 4?", "Name a colour.",
             "Thanks, goodbye."]


def system_prompt(n_rules: int) -> str:
    topics = ["the river", "the mountain", "the library", "the market", "the harbour", "the garden", "the bridge",
              "the station", "the castle", "the forest", "the museum", "the bakery"]
    return "You are a helpful assistant for a town guide. Follow these rules.\n" + "\n".join(
        f"Rule {i}: when a visitor asks about {topics[i % len(topics)]}, answer politely, mention opening hour "
        f"{8 + i % 10} o'clock and ticket price {i * 3 % 17 + 2} euros, and suggest visiting {topics[(i * 5) % 12]} "
        f"afterwards." for i in range(1, n_rules + 1))


class Serve:
    """A ``tinyvllm serve`` subprocess on a free port (``--port 0 --port-file``)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port_file = log.with_suffix(".port")
        self.port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--model", MODEL, "--port", "0",
               "--port-file", str(self.port_file), *args]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
            try:
                if self.port_file.exists() and httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("server did not start")
            time.sleep(0.5)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{int(self.port_file.read_text())}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _post(base: str, path: str, body: dict) -> tuple[dict, float]:
    t = time.perf_counter()
    r = httpx.post(base + path, json=body, timeout=600)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t


def responses_turn(base: str, system: str, q: str, prev: str | None, salt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "instructions": system, "input": q, "max_output_tokens": max_tokens, "temperature": 0,
            "cache_salt": salt, "prefix_cache_debug": True}
    if prev:
        body["previous_response_id"] = prev
    r, dt = _post(base, "/v1/responses", body)
    u = r["usage"]
    d = u["input_tokens_details"]
    text = "".join(c["text"] for o in r["output"] if o["type"] == "message" for c in o["content"])
    return {"id": r["id"], "input_tokens": u["input_tokens"], "cached": d["cached_tokens"],
            "tier": d.get("cached_tokens_tier", 0), "output_tokens": u["output_tokens"], "seconds": dt, "text": text,
            "continuation": (u.get("prefix_cache") or {}).get("continuation")}


def chat_turn(base: str, history: list[dict], salt: str, max_tokens: int) -> dict:
    r, dt = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": max_tokens,
                                                 "temperature": 0, "cache_salt": salt})
    u = r["usage"]
    d = u["prompt_tokens_details"]
    return {"input_tokens": u["prompt_tokens"], "cached": d["cached_tokens"], "tier": d.get("cached_tokens_tier", 0),
            "output_tokens": u["completion_tokens"], "seconds": dt, "text": r["choices"][0]["message"]["content"]}


def chain(base: str, system: str, salt: str, turns: int, max_tokens: int) -> tuple[list[dict], list[dict]]:
    """``turns`` turns by previous_response_id, then the same turns statelessly to chat completions."""
    resp, prev = [], None
    for q in QUESTIONS[:turns]:
        resp.append(responses_turn(base, system, q, prev, salt + "-resp", max_tokens))
        prev = resp[-1]["id"]
    chat, history = [], [{"role": "system", "content": system}]
    for q in QUESTIONS[:turns]:
        history.append({"role": "user", "content": q})
        chat.append(chat_turn(base, history, salt + "-chat", max_tokens))
        history.append({"role": "assistant", "content": chat[-1]["text"]})
    return resp, chat


def _pct(row: dict) -> str:
    return f"{100 * row['cached'] / row['input_tokens']:.1f}%"


def table(resp: list[dict], chat: list[dict], label: str = "turn") -> str:
    lines = [f"| {label} | input tokens | Responses: cached (tier) | % cached | s | chat (stateless): cached (tier) "
             f"| % cached | s | same text | prompt built |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, (r, c) in enumerate(zip(resp, chat), 1):
        lines.append(f"| {i} | {r['input_tokens']} / {c['input_tokens']} | {r['cached']} ({r['tier']}) | {_pct(r)} | "
                     f"{r['seconds']:.2f} | {c['cached']} ({c['tier']}) | {_pct(c)} | {c['seconds']:.2f} | "
                     f"{'yes' if r['text'] == c['text'] else 'no'} | {r.get('continuation')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results/responses_warm_kv")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rules", type=int, default=50, help="system prompt length (50 rules: ~2K tokens)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--serve-args", default="--dtype bfloat16 --max-model-len 4096 --kv-cache-memory 512MiB",
                    help="extra flags of tinyvllm serve")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="responses_warm_kv_"))
    common = [*args.serve_args.split(), "--kv-offload-size", "512MiB", "--kv-offload-path", str(work / "tier"),
              "--responses-store-path", str(work / "responses.sqlite")]
    system = system_prompt(args.rules)
    srv = Serve(common, out / "server1.log")
    try:
        n_sys = len(httpx.post(srv.base + "/tokenize", json={"model": MODEL, "prompt": system}).json()["tokens"])
        salt = f"run{int(time.time())}"
        resp, chat = chain(srv.base, system, salt, args.turns, args.max_tokens)
        # part 3: turn 1 before the restart
        r1 = responses_turn(srv.base, system, QUESTIONS[0], None, salt + "-restart-resp", args.max_tokens)
        history = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
        c1 = chat_turn(srv.base, history, salt + "-restart-chat", args.max_tokens)
        history.append({"role": "assistant", "content": c1["text"]})
    finally:
        srv.stop()
    srv = Serve(common, out / "server2.log")
    try:
        r2 = responses_turn(srv.base, system, QUESTIONS[1], r1["id"], salt + "-restart-resp", args.max_tokens)
        history.append({"role": "user", "content": QUESTIONS[1]})
        c2 = chat_turn(srv.base, history, salt + "-restart-chat", args.max_tokens)
    finally:
        srv.stop()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    result = {"system_prompt_tokens": n_sys, "cpu": cpu, "date": time.strftime("%Y-%m-%d"), "chain_responses": resp,
              "chain_chat": chat, "restart": {"responses": [r1, r2], "chat": [c1, c2]}, "args": vars(args)}
    (out / "responses_warm_kv.json").write_text(json.dumps(result, indent=1))
    print(f"system prompt: {n_sys} tokens; CPU: {cpu}\n")
    print(f"{args.turns}-turn chain (input tokens: Responses / chat):\n")
    print(table(resp, chat))
    print("\nturn 2 after a restart on the same --kv-offload-path and store (turn 1 before it):\n")
    print(table([r1, r2], [c1, c2]))


if __name__ == "__main__":
    main()
