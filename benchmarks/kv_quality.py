"""Quality of a quantized KV cache (``--kv-cache-dtype int8|fp8``) against the bf16 cache, same model,
same kernels otherwise (issue 39).

Per prompt: the bf16 cache's greedy continuation (``--tokens`` tokens, EOS ignored) is the reference;
each KV dtype is teacher-forced along it (prompt + continuation as one prompt) and its full next-token
distributions are captured at the continuation's positions. Reported per KV dtype: mean KL(bf16 || kv)
in nats, the fraction of positions whose argmax equals bf16's, and greedy outputs equal to bf16's.

Prompt sets: ``chat``: the 20 chat prompts of benchmarks/gguf_quality.py (the issue's table);
``long``: 8 retrieval prompts of 3-6K tokens (a fact stated in the first ~100 tokens, filler after it,
then a question about the fact).

    .venv/bin/python benchmarks/kv_quality.py --set chat --kv int8 fp8
    .venv/bin/python benchmarks/kv_quality.py --set long --kv int8 fp8 --tokens 8
    .venv/bin/python benchmarks/kv_quality.py --set chat --kv int8 int8/bf16qk int8/exp4   # int8 kernels
    .venv/bin/python benchmarks/kv_quality.py --set chat --no-amx --kv int8 int8/pv16   # int8 vs bf16 P V
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_quality import PROMPTS as CHAT20  # noqa: E402

FACTS = [("the vault code", "7342"), ("Maria's favourite city", "Lisbon"), ("the ship's name", "Aurora"),
         ("the password of the lab", "falcon"), ("the meeting day", "Thursday"), ("the captain's dog", "Biscuit"),
         ("the colour of the door", "green"), ("the winning number", "58")]
FILLER = ["The committee reviewed the quarterly figures and asked for a second opinion on the budget.",
          "Rain fell over the hills for most of the afternoon, and the river rose by a few centimetres.",
          "A new bakery opened near the station; its bread sold out before noon on the first day.",
          "The engineers replaced two pumps and logged the pressure readings every hour.",
          "Several students borrowed books about astronomy, geology and the history of maps.",
          "The train to the coast was delayed because of maintenance work on the bridge.",
          "In the garden, tomatoes ripened slowly while the beans climbed the wooden frame.",
          "The museum extended its opening hours for the exhibition of old photographs."]


def long_prompts(llm, lengths=(3000, 3500, 4000, 4500, 5000, 5500, 6000, 3200)) -> list[list[int]]:
    rng = random.Random(39)
    out = []
    for (what, value), n in zip(FACTS, lengths):
        head = f"Remember this: {what} is {value}.\n\n"
        body = []
        text = head
        while len(llm.llm_engine.chat_prompt_ids([{"role": "user", "content": text}])) < n:
            body.append(" ".join(rng.choice(FILLER) for _ in range(8)))
            text = head + "\n".join(body) + f"\n\nQuestion: what is {what}? Answer in a few words."
        out.append(llm.llm_engine.chat_prompt_ids([{"role": "user", "content": text}]))
    return out


def capture_logits(llm):
    """Wrap the model's compute_logits: every call's float32 rows are appended to the returned list."""
    model = llm.llm_engine.core.runner.model
    rows: list[torch.Tensor] = []
    orig = model.compute_logits

    def wrapped(h):
        out = orig(h)
        rows.append(out.float().clone())
        return out

    model.compute_logits = wrapped
    return rows


def set_int8_variant(arm: str) -> str:
    """Select the int8 attention kernel an arm names in this process's C++ kernels, and return the arm's
    ``--kv-cache-dtype``. ``int8``: the default (int8 Q K^T; P V in int8 on the AVX-512 vector path, bf16
    on AMX); ``int8/pv16``: P V in bf16 on the vector path too (the kernel before the int8 P V);
    ``int8/exp4``: the degree-4 exp2 (and so bf16 P V: the int8 P V runs with the degree-3 one only);
    ``int8/bf16qk``: the int8 cache on bf16 tiles."""
    from tinyvllm.kernels.cpu import cpu_kernels

    kv, _, variant = arm.partition("/")
    if variant not in ("", "bf16qk", "exp4", "pv16"):
        raise SystemExit(f"unknown int8 kernel variant {variant!r} in {arm!r}: bf16qk, exp4 or pv16")
    kernels = cpu_kernels()
    if kernels is not None and hasattr(kernels, "set_int8_attention"):
        kernels.set_int8_attention(variant != "bf16qk", 0, variant != "exp4", variant != "pv16")
    return kv


def run(kv: str, prompts: list[list[int]], refs: list[list[int]] | None, tokens: int, threads: int):
    """``kv``: a ``--kv-cache-dtype``, or ``int8/bf16qk`` (the int8 cache on the bf16 tiles, the kernel
    before the int8 Q K^T), ``int8/exp4`` (the int8 Q K^T with the bf16 kernel's degree-4 exp2) or
    ``int8/pv16`` (the int8 Q K^T with P V in bf16 on the vector path; the default's P V is int8 there)."""
    from tinyvllm import LLM, SamplingParams

    kv = set_int8_variant(kv)
    llm = LLM("SmolLM2-135M-Instruct", dtype="bfloat16", kv_cache_dtype=kv, max_num_batched_tokens=512,
              kv_cache_memory="2GiB")
    if threads:
        torch.set_num_threads(threads)
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))]
    refs = refs or greedy
    rows = capture_logits(llm)
    dists = []
    for p, c in zip(prompts, refs):
        rows.clear()
        llm.generate([{"prompt_token_ids": p + c}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        allrows = torch.cat(rows)  # prompt-logprob rows (positions 0..L-2), then the sampled row (L-1)
        dists.append(torch.log_softmax(allrows[len(p) - 1:len(p) - 1 + len(c)].double(), -1))
    return greedy, dists


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=("chat", "long"), default="chat")
    ap.add_argument("--kv", nargs="+", default=["int8", "fp8"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-amx", action="store_true", help="attention on the AVX-512 vector path, not AMX tiles "
                    "(every arm, the bf16 reference included; the int8 P V exists only there)")
    args = ap.parse_args()
    from tinyvllm import LLM
    from tinyvllm.kernels.cpu import cpu_kernels

    if args.no_amx and (kernels := cpu_kernels()) is not None:
        kernels.set_amx_attention(False)

    if args.set == "chat":
        probe = LLM("SmolLM2-135M-Instruct", dtype="bfloat16", kv_cache_memory="64MiB")
        prompts = [probe.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in CHAT20]
    else:
        probe = LLM("SmolLM2-135M-Instruct", dtype="bfloat16", kv_cache_memory="64MiB")
        prompts = long_prompts(probe)
    del probe
    print(f"{args.set}: {len(prompts)} prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens", flush=True)
    t0 = time.time()
    ref_greedy, ref_d = run("bfloat16", prompts, None, args.tokens, args.threads)
    print(f"bfloat16 reference done ({time.time() - t0:.0f} s)", flush=True)
    print("| KV dtype | mean KL (nats) | max KL | argmax agreement | greedy equal |")
    print("|---|---|---|---|---|")
    for kv in args.kv:
        greedy, d = run(kv, prompts, ref_greedy, args.tokens, args.threads)
        kls = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref_d, d)])
        agree = torch.cat([(r.argmax(-1) == g.argmax(-1)).double() for r, g in zip(ref_d, d)])
        eq = sum(a == b for a, b in zip(ref_greedy, greedy))
        print(f"| {kv} | {kls.mean():.5f} | {kls.max():.4f} | {agree.mean():.4f} | {eq}/{len(prompts)} |", flush=True)
    if args.set == "long":
        from tinyvllm.engine.tokenizer import load_tokenizer  # noqa: F401
        print("answers (bf16):", [v for _, v in FACTS])


if __name__ == "__main__":
    main()
