#!/usr/bin/env python3
"""Quality of the native GGUF path: greedy agreement and mean KL of next-token distributions against the
dequantized float32 model, on 20 chat prompts (the 6 of tests/conftest.py's CHAT_PROMPTS and 14 more).

    .venv/bin/python benchmarks/gguf_quality.py [--model SmolLM2-135M-Instruct] [--llama-server URL]
        [--positions 8] [--json FILE]

Variants: ``bf16`` (dequantized at load, ``--quantization none``) and ``native`` (``--quantization gguf``)
with each of its activation arithmetics (``TINYVLLM_GGUF_ACTIVATIONS=int8``, then ``bf16``; int8 only
where a vector int8 kernel is built, AVX512-VNNI or AVX2), in a bfloat16 and then a float32 model
(``--dtype float32``: the activations reach the kernels unrounded and their outputs stay float32), each
against ``float32`` (``--quantization none --dtype float32``).
Per prompt, up to ``--positions`` full-vocabulary next-token distributions (captured from
``compute_logits``): at the end of the prompt, then after each of the first tokens of float32's own
greedy continuation, fed to every variant as prompt tokens (teacher forcing, as llama.cpp's
``llama-perplexity --kl-divergence`` scores a fixed text; it stops at an end-of-sequence token). For
each: KL(fp32 || variant) in nats and whether the argmax agrees; the mean KL is over all of them, "KL
at end" over the end-of-prompt ones only (``--positions 1`` measures only those). Also, over a free
8-token greedy continuation, the number of tokens equal to fp32's before the first difference. With
``--llama-server`` (a llama-server on the same GGUF), the same token ids are sent to its
``/completion`` with ``n_probs`` = the vocabulary size, which returns every token's log-probability,
so llama.cpp gets the same full KL (a token it leaves out, if any, is floored at the smallest
probability it reported), and the ratio of each variant's mean KL to llama.cpp's is printed with a
95 % paired bootstrap interval that resamples whole prompts. A *top-100 KL* is also printed for every
row: the sum over fp32's top-100 tokens of p log(p / q) with q known only on the variant's own top 100
(floored likewise). It is what a top-100 logprobs response allows; it is dominated by a few flat
distributions and moved 3x under perturbations as small as rounding the activations to bf16
(docs/benchmarks.md), so read the full KL.
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
LLAMA_CPP = "llama.cpp (llama-server)"
GEN = 8  # greedy continuation length (kept short: the shared 2-core machine)


def run_variant(model: str, forced: list[list[int]] | None = None, positions: int = GEN, **kw):
    """Per prompt: the log-softmax next-token distributions at ``positions`` points (the end of the
    prompt, then after each of the first ``positions - 1`` tokens of ``forced[i]``, float32's greedy
    continuation, fed as prompt tokens: teacher forcing, so every variant is scored on the same token
    sequences; ``forced=None`` uses the variant's own continuation, which is how the reference runs),
    and the variant's own free-running greedy continuation of ``GEN`` tokens."""
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
    for n, i in enumerate(ids):
        captured.clear()
        out = llm.generate([{"prompt_token_ids": i}], SamplingParams(temperature=0.0, max_tokens=GEN))
        gens.append(list(out[0].outputs[0].token_ids))
        per = [torch.log_softmax(captured[0].double(), -1)]
        tail = gens[-1] if forced is None else forced[n]
        for k in range(1, min(positions, len(tail) + 1)):
            if tail[k - 1] in llm.llm_engine.eos_token_ids:
                break
            captured.clear()
            llm.generate([{"prompt_token_ids": i + tail[:k]}], SamplingParams(temperature=0.0, max_tokens=1))
            per.append(torch.log_softmax(captured[0].double(), -1))
        dists.append(per)
    m.compute_logits = orig
    return ids, dists, gens


def llama_server_probs(url: str, ids: list[list[int]], forced: list[list[int]], npos: list[int],
                       vocab: int) -> list[list[dict[int, float]]]:
    """Per prompt and position (as :func:`run_variant` with ``forced``), {token id: log-probability} of
    llama-server's next-token distribution (all ``vocab`` tokens: llama-server's ``n_probs`` is not
    capped)."""
    res = []
    for i, tail, n in zip(ids, forced, npos):
        per = []
        for k in range(n):
            body = json.dumps({"prompt": i + tail[:k], "n_predict": 1, "temperature": 0, "n_probs": vocab,
                               "post_sampling_probs": False, "cache_prompt": False}).encode()
            req = urllib.request.Request(url.rstrip("/") + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                data = json.loads(r.read())
            top = data["completion_probabilities"][0]["top_logprobs"]
            per.append({int(t["id"]): float(t["logprob"]) for t in top})
        res.append(per)
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
    ap.add_argument("--positions", type=int, default=GEN,
                    help="next-token distributions per prompt: the end of the prompt, then teacher-forced "
                         "along float32's greedy continuation (1: the end of the prompt only)")
    ap.add_argument("--json", default=None, help="write each variant's KL per prompt and position here")
    args = ap.parse_args()
    ids, ref, ref_gen = run_variant(args.model, positions=args.positions, dtype="float32", quantization="none")
    npos = [len(r) for r in ref]
    rows = []  # (variant, KL per prompt and position, argmax agreements, greedy prefix, top-100 KLs)
    from tinyvllm.kernels.cpu import cpu_kernels
    from tinyvllm.model import gguf_quant

    variants = {"bf16 (dequantized)": (dict(dtype="bfloat16", quantization="none"), None)}
    int8 = cpu_kernels().gemm_gguf_q8_isa() != "scalar"  # a vector int8 kernel (AVX512-VNNI or AVX2)
    if int8:
        variants["native, int8 activations"] = (dict(dtype="bfloat16", quantization="gguf"), "int8")
    variants["native, bf16 activations"] = (dict(dtype="bfloat16", quantization="gguf"), "bf16")
    if int8:  # a float32 model: the int8 quantizer reads float32 (llama.cpp's arithmetic)
        variants["native float32, int8 acts"] = (dict(dtype="float32", quantization="gguf"), "int8")
    variants["native float32, f32 acts"] = (dict(dtype="float32", quantization="gguf"), "bf16")
    for name, (kw, acts) in variants.items():
        if acts is not None:
            os.environ["TINYVLLM_GGUF_ACTIVATIONS"] = acts
            gguf_quant._INT8_ACTS.clear()  # the choice is cached per process; this script runs both
        _, d, g = run_variant(args.model, forced=ref_gen, positions=args.positions, **kw)
        kl = [[float((r.exp() * (r - x)).sum()) for r, x in zip(rp, xp)] for rp, xp in zip(ref, d)]
        agree = sum(int(r.argmax() == x.argmax()) for rp, xp in zip(ref, d) for r, x in zip(rp, xp))
        prefix = []
        for a, b in zip(ref_gen, g):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefix.append(n)
        tkl = [topn_kl(r, {i: float(x[i]) for i in torch.topk(x, TOPN).indices.tolist()})
               for rp, xp in zip(ref, d) for r, x in zip(rp, xp)]
        rows.append((name, kl, agree, f"{sum(prefix) / len(prefix):.1f} ({sum(p == GEN for p in prefix)} all)", tkl))
    if args.llama_server:
        q = llama_server_probs(args.llama_server, ids, ref_gen, npos, ref[0][0].numel())
        kl = [[full_kl(r, x) for r, x in zip(rp, xp)] for rp, xp in zip(ref, q)]
        tkl = [topn_kl(r, dict(sorted(x.items(), key=lambda t: -t[1])[:TOPN]))
               for rp, xp in zip(ref, q) for r, x in zip(rp, xp)]
        agree = sum(int(int(r.argmax()) == max(x, key=x.get)) for rp, xp in zip(ref, q) for r, x in zip(rp, xp))
        rows.append((LLAMA_CPP, kl, agree, "-", tkl))
    per_prompt = {r[0]: r[1] for r in rows}
    if args.json:
        Path(args.json).write_text(json.dumps(per_prompt))
    total = sum(npos)
    print(f"{len(PROMPTS)} prompts, {total} next-token distributions (up to {args.positions} per prompt, "
          f"teacher-forced on float32's greedy continuation); reference: dequantized float32 ({args.model})")
    print(f"{'variant':28s} {'mean KL':>10s} {'max KL':>10s} {'KL at end':>10s} {'argmax=':>9s} "
          f"{'greedy prefix (of ' + str(GEN) + ')':>22s} {'top100 KL':>10s}")
    for name, kl, agree, prefix, tkl in rows:
        flat = [v for per in kl for v in per]
        end = [per[0] for per in kl]
        print(f"{name:28s} {sum(flat) / len(flat):10.2e} {max(flat):10.2e} {sum(end) / len(end):10.2e} "
              f"{agree:4d}/{total:<4d} {prefix:>22s} {sum(tkl) / len(tkl):10.2e}")
    if LLAMA_CPP in per_prompt:
        # Mean KL relative to llama.cpp's, with a 95 % interval from a paired bootstrap over the prompts
        # (each resampled prompt brings all its positions, for both: positions of one prompt are not
        # independent), i.e. how much of a difference these prompts can resolve.
        def sums(kl):
            return torch.tensor([sum(per) for per in kl], dtype=torch.float64)

        ref_s = sums(per_prompt[LLAMA_CPP])
        idx = torch.randint(0, len(PROMPTS), (10_000, len(PROMPTS)), generator=torch.Generator().manual_seed(0))
        print("mean KL / llama.cpp's (95 % paired bootstrap interval over the prompts):")
        for name, kl in per_prompt.items():
            if name == LLAMA_CPP:
                continue
            v = sums(kl)
            boot = (v[idx].sum(1) / ref_s[idx].sum(1)).sort().values
            print(f"  {name:28s} {float(v.sum() / ref_s.sum()):.2f} "
                  f"[{float(boot[250]):.2f}, {float(boot[9749]):.2f}]")


if __name__ == "__main__":
    main()
