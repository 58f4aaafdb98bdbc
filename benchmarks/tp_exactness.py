"""TP=2 against TP=1 on the embedded SmolLM2 (issue 38): greedy tokens and logprobs on the 20 chat prompts of
benchmarks/gguf_quality.py.

Per dtype: each prompt's greedy continuation (``--tokens``) at TP=1 and at TP=2 (two rank processes, gloo);
then TP=1's sequence (prompt + its continuation) scored by both with ``prompt_logprobs`` (teacher forcing:
the same tokens in both), and the largest |logprob difference| of those tokens. Where a continuation
differs, the first differing position, both tokens, and TP=1's logprob gap between them (a near-tie that the
all-reduce's summation order flipped).

    PYTHONPATH=. python benchmarks/tp_exactness.py --dtype float32 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_quality import PROMPTS  # noqa: E402


def run(tp: int, dtype: str, tokens: int, forced: list[list[int]] | None, ids: list[list[int]] | None):
    from tinyvllm import LLM, SamplingParams

    llm = LLM("SmolLM2-135M-Instruct", dtype=dtype, tensor_parallel_size=tp, max_model_len=1024)
    eng = llm.llm_engine
    if ids is None:
        ids = [eng.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], sp)
    gens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]
    forced = forced or gens
    scored = llm.generate([{"prompt_token_ids": i + f} for i, f in zip(ids, forced)],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    seq_lps = [[None if d is None else next(iter(d.values())).logprob if len(d) == 1 else d[tok].logprob
                for d, tok in zip(o.prompt_logprobs, i + f)] for o, i, f in zip(scored, ids, forced)]
    eng.core.shutdown()
    return ids, gens, lps, seq_lps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    ids, g1, lp1, s1 = run(1, args.dtype, args.tokens, None, None)
    _, g2, lp2, s2 = run(2, args.dtype, args.tokens, g1, ids)
    same = sum(a == b for a, b in zip(g1, g2))
    worst = max(abs(a - b) for x, y in zip(s1, s2) for a, b in zip(x, y) if a is not None and b is not None)
    flips = []
    for n, (a, b) in enumerate(zip(g1, g2)):
        if a != b:
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            d = lp1[n][k]
            gap = d[a[k]] - d[b[k]] if b[k] in d else None
            flips.append({"prompt": n, "position": k, "tp1_token": a[k], "tp2_token": b[k], "tp1_logprob_gap": gap})
    print(json.dumps({"dtype": args.dtype, "prompts": len(ids), "tokens": args.tokens,
                      "identical_continuations": same, "max_abs_logprob_diff_teacher_forced": worst,
                      "flips": flips}, indent=1))


if __name__ == "__main__":
    main()
