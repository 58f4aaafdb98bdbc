"""``tinyvllm bench throughput``: offline throughput of the engine, in-process.

Sends ``--num-prompts`` random token-id prompts of ``--input-len`` tokens, each
generating exactly ``--output-len`` tokens (``ignore_eos``), all at once through
``LLM.generate``, and reports requests/s, output tokens/s and total tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tinyvllm.config import EngineArgs


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="requests, all sent at once")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (random ids)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--min-output-len", type=int, default=None,
                   help="draw each request's output length uniformly from [min, --output-len] (mixed lengths)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--result-file", default=None, help="write the result as JSON here")


def random_token_prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """Deterministic random prompts (token ids in [100, vocab_size))."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(input_len)]} for _ in range(n)]


def run_throughput(llm: Any, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   min_output_len: int | None = None) -> dict[str, Any]:
    """Time one ``generate`` over the whole batch; returns throughput figures (tokens/s, requests/s)."""
    from tinyvllm.sampling_params import SamplingParams

    vocab = llm.llm_engine.core.model.config.vocab_size
    prompts = random_token_prompts(num_prompts, input_len, vocab, seed)
    rng = random.Random(seed + 1)
    lens = [output_len if min_output_len is None else rng.randint(min_output_len, output_len) for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = llm.stats()
    steps = after["num_steps"] - before["num_steps"]
    decode_tokens = after["decode_tokens"] - before["decode_tokens"]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "elapsed_s": elapsed, "requests_per_s": num_prompts / elapsed,
        "output_tokens_per_s": out_tokens / elapsed, "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "min_output_len": min_output_len, "engine_stats": after, "num_steps": steps,
        # Mean sequences decoding per step: static batching leaves slots idle while a batch drains.
        "mean_decode_batch": decode_tokens / steps if steps else 0.0,
    }


def _write_result(path: str | None, res: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=2, default=str))


def main_throughput(args: argparse.Namespace, engine_args: EngineArgs, make_llm: Callable[..., Any]
                    ) -> dict[str, Any]:
    """``bench throughput``: ``make_llm(**engine options)`` builds the offline ``LLM`` (the caller passes
    the class, so the benchmarks stay below the entry points)."""
    engine_kwargs = dataclasses.asdict(engine_args)
    llm = make_llm(**engine_kwargs)
    # Warm-up (first-touch of KV pages, allocator) on a tiny batch.
    run_throughput(llm, 2, 16, 4, seed=12345)
    res = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.dataset_seed,
                         args.min_output_len)
    res["engine"] = dict(engine_kwargs)
    print(f"{'requests':>10} {'in':>6} {'out':>6} {'elapsed s':>10} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10}"
          f" {'steps':>6} {'seqs/step':>9}")
    print(f"{res['num_prompts']:>10} {res['input_len']:>6} {res['output_len']:>6} {res['elapsed_s']:>10.2f} "
          f"{res['requests_per_s']:>8.2f} {res['output_tokens_per_s']:>10.1f} {res['total_tokens_per_s']:>10.1f}"
          f" {res['num_steps']:>6} {res['mean_decode_batch']:>9.2f}")
    _write_result(args.result_file, res)
    return res


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per sequence (random ids)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences run together")
    p.add_argument("--num-iters", type=int, default=3, help="repetitions; the best is reported")
    p.add_argument("--result-file", default=None, help="write the result as JSON here")


def run_latency(llm: Any, input_len: int, output_len: int, batch_size: int = 1, num_iters: int = 3,
                seed: int = 0) -> dict[str, Any]:
    """Prefill speed (time until the last prompt token of the batch is computed, chunked by the
    token budget) and decode speed: the mean time of the steps in which all ``batch_size`` sequences
    decode and no prompt token is computed (when the prefill is chunked over several steps, the first
    sequences finish before the last ones start, so steps of a smaller batch are left out; if there is
    no full-batch step, every decode-only step counts and ``decode_batch`` says the mean batch). Best of
    ``num_iters``; prefix caching is bypassed by fresh random prompts each iteration.

    Returns:
        dict with ``prefill_s`` (seconds), ``prefill_tokens_per_s``, ``decode_step_s`` (seconds),
        ``decode_batch`` (sequences per timed step), ``decode_tokens_per_s`` and ``num_decode_steps``.
    """
    from tinyvllm.sampling_params import SamplingParams

    eng = llm.llm_engine
    vocab = eng.core.model.config.vocab_size
    prefill_s: list[float] = []
    decode: list[tuple[float, float, int]] = []  # (step seconds, batch, steps timed) per iteration
    for it in range(num_iters):
        prompts = random_token_prompts(batch_size, input_len, vocab, seed + 1000 * it)
        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for p in prompts:
            eng.add_request(p, sp)
        t0 = time.perf_counter()
        t1 = None
        steps: list[tuple[float, int]] = []  # decode-only steps: (seconds, sequences)
        while eng.has_unfinished_requests():
            ts = time.perf_counter()
            eng.step()
            te = time.perf_counter()
            it_stats = eng.core.last_iteration
            if it_stats.num_prefill_tokens > 0:
                t1 = te  # the last step that still computed prompt tokens
            elif it_stats.num_decode_tokens > 0:
                steps.append((te - ts, it_stats.num_decode_tokens))
        prefill_s.append((t1 or time.perf_counter()) - t0)
        full = [t for t, n in steps if n == batch_size]
        if full:
            decode.append((sum(full) / len(full), batch_size, len(full)))
        elif steps:
            decode.append((sum(t for t, _ in steps) / len(steps), sum(n for _, n in steps) / len(steps), len(steps)))
    best_prefill = min(prefill_s)
    best_step, batch, n_steps = min(decode) if decode else (float("nan"), float(batch_size), 0)
    return {
        "input_len": input_len, "output_len": output_len, "batch_size": batch_size,
        "prefill_s": best_prefill, "prefill_tokens_per_s": batch_size * input_len / best_prefill,
        "decode_step_s": best_step, "decode_batch": batch, "num_decode_steps": n_steps,
        "decode_tokens_per_s": batch / best_step,
    }


def main_latency(args: argparse.Namespace, engine_args: EngineArgs, make_llm: Callable[..., Any]
                 ) -> dict[str, Any]:
    """``bench latency``: ``make_llm`` as in :func:`main_throughput`."""
    engine_kwargs = dataclasses.asdict(engine_args)
    llm = make_llm(**engine_kwargs)
    run_latency(llm, 16, 4, 1, 1, seed=777)  # warm-up
    res = run_latency(llm, args.input_len, args.output_len, args.batch_size, args.num_iters)
    res["engine"] = dict(engine_kwargs)
    print(f"{'dtype':>9} {'batch':>6} {'in':>6} {'prefill s':>10} {'prefill tok/s':>14} {'step ms':>8} {'decode tok/s':>13}")
    print(f"{str(engine_kwargs.get('dtype')):>9} {res['batch_size']:>6} {res['input_len']:>6} {res['prefill_s']:>10.3f} "
          f"{res['prefill_tokens_per_s']:>14.1f} {res['decode_step_s'] * 1000:>8.2f} {res['decode_tokens_per_s']:>13.1f}")
    _write_result(args.result_file, res)
    return res
