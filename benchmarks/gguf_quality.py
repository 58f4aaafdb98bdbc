#!/usr/bin/env python3
"""Quality of the native GGUF path: greedy agreement and mean KL of next-token distributions against the
dequantized float32 model, on 20 chat prompts (the 6 of tests/conftest.py's CHAT_PROMPTS and 14 more).

    .venv/bin/python benchmarks/gguf_quality.py [--model SmolLM2-135M-Instruct] [--llama-server URL]

Variants: ``bf16`` (dequantized at load, ``--quantization none``) and ``native`` (``--quantization gguf``),
each against ``float32`` (``--quantization none --dtype float32``). Per prompt: the full-vocabulary
next-token distribution at the end of the prompt (captured from ``compute_logits``), KL(fp32 || variant)
in nats; whether the argmax agrees; and over an 8-token greedy continuation, the number of tokens equal
to fp32's before the first difference. With ``--llama-server`` (a llama-server on the same GGUF), the
same prompts' token ids are sent to its ``/completion`` with ``n_probs`` = 100: it returns only the top
100 probabilities, so for every variant a *top-100 KL* is also printed: sum over fp32's top-100 tokens of
p log(p / q), q floored at the smallest reported probability where a token is missing (an
approximation, applied identically to all variants).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from conftest import CHAT_PROMPTS  # noqa: E402

PROMPTS = CHAT_PROMPTS + [
    "Name a famous painting by Leonardo da Vinci.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? Answer briefly.",
    "Write one sentence about autumn leaves.",
    "What is 12 times 12?",
    "Suggest a name for a pet goldfish.",
    "What language is spoken in Brazil?",
    "Describe a cat in three words.",
    "What does a thermometer measure?",
    "Recommend a good habit for mornings.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Tell me a fun fact about octopuses.",
]
TOPN = 100
GEN = 8  # greedy continuation length (kept short: the shared 2-core machine)


def run_variant(model: str, **kw):
    from tinyvllm import LLM, SamplingParams

    llm = LLM(model, **kw)
    m = llm.llm_engine.core.model
    captured = []
    orig = m.compute_logits

    def cap(h):
        out = orig(h)
        captured.append(out[-1].detach().float().clone())
        return out

    m.compute_logits = cap
    ids = [llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    dists, gens = [], []
    for i in ids:
        captured.clear()
        out = llm.generate([{"prompt_token_ids": i}], SamplingParams(temperature=0.0, max_tokens=GEN))
        dists.append(torch.log_softmax(captured[0].double(), -1))
        gens.append(list(out[0].outputs[0].token_ids))
    m.compute_logits = orig
    return ids, dists, gens


def llama_server_topn(url: str, ids: list[list[int]]) -> list[dict[int, float]]:
    res = []
    for i in ids:
        body = json.dumps({"prompt": i, "n_predict": 1, "temperature": 0, "n_probs": TOPN,
                           "post_sampling_probs": False, "cache_prompt": False}).encode()
        req = urllib.request.Request(url.rstrip("/") + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            data = json.loads(r.read())
        top = data["completion_probabilities"][0]["top_logprobs"]
        res.append({int(t["id"]): float(t["logprob"]) for t in top})
    return res


def topn_kl(p_log: torch.Tensor, q: dict[int, float]) -> float:
    top = torch.topk(p_log, TOPN).indices.tolist()
    floor = min(q.values())
    return sum(math.exp(p_log[t]) * (p_log[t].item() - q.get(t, floor)) for t in top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    ids, ref, ref_gen = run_variant(args.model, dtype="float32", quantization="none")
    rows = []
    variants = {"bf16 (dequantized)": dict(dtype="bfloat16", quantization="none"),
                "native gguf": dict(dtype="bfloat16", quantization="gguf")}
    for name, kw in variants.items():
        _, d, g = run_variant(args.model, **kw)
        kl = [float((r.exp() * (r - x)).sum()) for r, x in zip(ref, d)]
        agree = sum(int(r.argmax() == x.argmax()) for r, x in zip(ref, d))
        prefix = []
        for a, b in zip(ref_gen, g):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefix.append(n)
        tkl = [topn_kl(r, {i: float(x[i]) for i in torch.topk(x, TOPN).indices.tolist()}) for r, x in zip(ref, d)]
        rows.append((name, sum(kl) / len(kl), max(kl), agree, sum(prefix) / len(prefix),
                     sum(p == GEN for p in prefix), sum(tkl) / len(tkl)))
    if args.llama_server:
        q = llama_server_topn(args.llama_server, ids)
        tkl = [topn_kl(r, x) for r, x in zip(ref, q)]
        agree = sum(int(int(r.argmax()) == max(x, key=x.get)) for r, x in zip(ref, q))
        rows.append(("llama.cpp (llama-server)", float("nan"), float("nan"), agree, float("nan"), -1,
                     sum(tkl) / len(tkl)))
    print(f"{len(PROMPTS)} prompts; reference: dequantized float32 ({args.model})")
    print(f"{'variant':28s} {'mean KL':>10s} {'max KL':>10s} {'argmax=':>8s} {'greedy prefix':>14s} "
          f"{'all':>6s} {'top100 KL':>10s}")
    for r in rows:
        print(f"{r[0]:28s} {r[1]:10.2e} {r[2]:10.2e} {r[3]:5d}/{len(PROMPTS)} {r[4]:14.1f} {r[5]:6d} {r[6]:10.2e}")


if __name__ == "__main__":
    main()
