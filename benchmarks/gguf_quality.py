#!/usr/bin/env python3
"""Quality of the native GGUF path: greedy agreement and mean KL of next-token distributions against the
dequantized float32 model, on 20 chat prompts (the 6 of tests/conftest.py's CHAT_PROMPTS and 14 more).

    .venv/bin/python benchmarks/gguf_quality.py [--model SmolLM2-135M-Instruct] [--llama-server URL]

Variants: ``bf16`` (dequantized at load, ``--quantization none``) and ``native`` (``--quantization gguf``)
with each of its activation arithmetics (``TINYVLLM_GGUF_ACTIVATIONS=int8``, then ``bf16``; int8 only
where its VNNI kernel is built), each against ``float32`` (``--quantization none --dtype float32``).
Per prompt: the full-vocabulary next-token distribution at the end of the prompt (captured from
``compute_logits``), KL(fp32 || variant) in nats; whether the argmax agrees; and over an 8-token greedy
continuation, the number of tokens equal to fp32's before the first difference. With ``--llama-server``
(a llama-server on the same GGUF), the same prompts' token ids are sent to its ``/completion`` with
``n_probs`` = the vocabulary size, which returns every token's log-probability, so llama.cpp gets the
same full KL (a token it leaves out, if any, is floored at the smallest probability it reported). A
*top-100 KL* is also printed for every row: the sum over fp32's top-100 tokens of p log(p / q) with q
known only on the variant's own top 100 (floored likewise). It is what a top-100 logprobs response
allows; with 20 prompts it is dominated by a few flat distributions and moves 3x under perturbations
as small as rounding the activations to bf16 (docs/benchmarks.md), so read the full KL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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


def llama_server_probs(url: str, ids: list[list[int]], vocab: int) -> list[dict[int, float]]:
    """Per prompt, {token id: log-probability} of llama-server's next-token distribution (all ``vocab``
    tokens: llama-server's ``n_probs`` is not capped)."""
    res = []
    for i in ids:
        body = json.dumps({"prompt": i, "n_predict": 1, "temperature": 0, "n_probs": vocab,
                           "post_sampling_probs": False, "cache_prompt": False}).encode()
        req = urllib.request.Request(url.rstrip("/") + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            data = json.loads(r.read())
        top = data["completion_probabilities"][0]["top_logprobs"]
        res.append({int(t["id"]): float(t["logprob"]) for t in top})
    return res


def full_kl(p_log: torch.Tensor, q: dict[int, float]) -> float:
    """KL(p || q) over the whole vocabulary; q's missing tokens floored at its smallest probability."""
    floor = min(q.values())
    q_log = torch.full_like(p_log, floor)
    q_log[torch.tensor(list(q.keys()))] = torch.tensor(list(q.values()), dtype=p_log.dtype)
    return float((p_log.exp() * (p_log - q_log)).sum())


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
    per_prompt: dict[str, list[float]] = {}  # each variant's KL per prompt
    from tinyvllm.kernels.cpu import cpu_kernels
    from tinyvllm.model import gguf_quant

    variants = {"bf16 (dequantized)": (dict(dtype="bfloat16", quantization="none"), None)}
    if cpu_kernels().gemm_gguf_q8_isa() == "avx512_vnni":
        variants["native, int8 activations"] = (dict(dtype="bfloat16", quantization="gguf"), "int8")
    variants["native, bf16 activations"] = (dict(dtype="bfloat16", quantization="gguf"), "bf16")
    for name, (kw, acts) in variants.items():
        if acts is not None:
            os.environ["TINYVLLM_GGUF_ACTIVATIONS"] = acts
            gguf_quant._INT8_ACTS.clear()  # the choice is cached per process; this script runs both
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
        per_prompt[name] = kl
        rows.append((name, sum(kl) / len(kl), max(kl), agree, sum(prefix) / len(prefix),
                     sum(p == GEN for p in prefix), sum(tkl) / len(tkl)))
    if args.llama_server:
        q = llama_server_probs(args.llama_server, ids, ref[0].numel())
        kl = [full_kl(r, x) for r, x in zip(ref, q)]
        top = [dict(sorted(x.items(), key=lambda t: -t[1])[:TOPN]) for x in q]
        tkl = [topn_kl(r, x) for r, x in zip(ref, top)]
        agree = sum(int(int(r.argmax()) == max(x, key=x.get)) for r, x in zip(ref, q))
        rows.append(("llama.cpp (llama-server)", sum(kl) / len(kl), max(kl), agree, float("nan"), -1,
                     sum(tkl) / len(tkl)))
        per_prompt["llama.cpp"] = kl
    print(f"{len(PROMPTS)} prompts; reference: dequantized float32 ({args.model})")
    print(f"{'variant':28s} {'mean KL':>10s} {'max KL':>10s} {'argmax=':>8s} {'greedy prefix':>14s} "
          f"{'all':>6s} {'top100 KL':>10s}")
    for r in rows:
        print(f"{r[0]:28s} {r[1]:10.2e} {r[2]:10.2e} {r[3]:5d}/{len(PROMPTS)} {r[4]:14.1f} {r[5]:6d} {r[6]:10.2e}")
    if "llama.cpp" in per_prompt:
        # Mean KL relative to llama.cpp's, with a 95 % interval from a paired bootstrap over the prompts
        # (the same resampled prompts for both): how much of a difference 20 prompts can resolve.
        ref_kl = torch.tensor(per_prompt["llama.cpp"], dtype=torch.float64)
        idx = torch.randint(0, len(PROMPTS), (10_000, len(PROMPTS)), generator=torch.Generator().manual_seed(0))
        print("mean KL / llama.cpp's (95 % paired bootstrap interval over the prompts):")
        for name, kl in per_prompt.items():
            if name == "llama.cpp":
                continue
            v = torch.tensor(kl, dtype=torch.float64)
            boot = (v[idx].mean(1) / ref_kl[idx].mean(1)).sort().values
            print(f"  {name:28s} {float(v.mean() / ref_kl.mean()):.2f} "
                  f"[{float(boot[250]):.2f}, {float(boot[9749]):.2f}]")


if __name__ == "__main__":
    main()
