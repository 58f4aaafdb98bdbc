#!/usr/bin/env python3
"""vLLM's offline throughput on the same workload as ``tinyvllm bench throughput`` (run with vLLM's Python).

    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm-venv/bin/python benchmarks/offline_vllm.py MODEL_DIR \
        --num-prompts 64 --input-len 256 --output-len 128

The prompts are the same token ids tinyvllm's benchmark draws (``random.Random(seed)``, ids in
[100, vocab)); every request decodes exactly ``--output-len`` tokens (``ignore_eos``), greedy.
This file does not import tinyvllm: vLLM is not a dependency of the project.
"""

import argparse
import json
import random
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, enforce_eager=args.enforce_eager)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(args.seed)  # same draw as tinyvllm.benchmarks.throughput.random_token_prompts
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(args.input_len)])
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"engine": "vllm", "num_prompts": args.num_prompts, "input_len": args.input_len,
                      "output_len": args.output_len, "elapsed_s": dt, "output_tokens_per_s": n_out / dt}))


if __name__ == "__main__":
    main()
