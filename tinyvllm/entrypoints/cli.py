"""Command line: ``tinyvllm serve | generate | chat | bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tinyvllm.config import DEFAULT_MODEL, LOAD_FORMATS


_FMT = argparse.ArgumentDefaultsHelpFormatter  # every subcommand's --help shows the defaults


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options under vLLM's flag names."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="alias (SmolLM2-135M-Instruct), path to a .gguf file, or a Hugging Face model directory")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16 or float32")
    g.add_argument("--max-model-len", type=int, default=None, help="max tokens per sequence (prompt + output)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max running requests per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prefixes across requests")
    g.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 1GiB, 512MiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="explicit number of KV blocks (overrides memory)")
    g.add_argument("--scheduling-policy", choices=["continuous", "static"], default="continuous",
                   help="continuous: rebuild the batch every step; static: admit a new batch only when one finishes")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (and of --load-format dummy)")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every step eagerly (no CUDA-graph capture of the decode step)")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="auto: read the model's weights; dummy: seeded random weights of the shapes in config.json "
                        "(a directory with config.json and tokenizer files is enough; for benchmarks)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, scheduling_policy=args.scheduling_policy, seed=args.seed,
        device=args.device, enforce_eager=args.enforce_eager, load_format=args.load_format,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")


def _sampling(args: argparse.Namespace):
    from tinyvllm.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.sampling_seed)


def _stream(engine, prompt, params) -> str:
    """Run one request to completion, printing text as it arrives; return the full text."""
    rid = engine.add_request(prompt, params)
    text = []
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            if out.request_id == rid and out.outputs:
                piece = out.outputs[0].text
                text.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    _stream(llm.llm_engine, args.prompt, _sampling(args))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    eng = llm.llm_engine
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(f"tinyvllm chat with {eng.model_name} — empty line or Ctrl-D to quit, /reset to clear history.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        ids = eng.chat_prompt_ids(messages)
        reply = _stream(eng, {"prompt_token_ids": ids}, _sampling(args))
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.openai.api_server import run_server

    return run_server(args) or 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinyvllm", description="tinyvllm: LLM inference engine and server")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=_FMT)
    add_engine_args(p)
    try:
        from tinyvllm.entrypoints.openai.api_server import add_server_args
    except ImportError:  # server module not present
        add_server_args = None
    if add_server_args is not None:
        add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate from one prompt and print the text as it streams",
                       formatter_class=_FMT)
    p.add_argument("prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal (streams tokens)", formatter_class=_FMT)
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="benchmarks", formatter_class=_FMT)
    bsub = p.add_subparsers(dest="bench_command", required=True)
    from tinyvllm.benchmarks import serve as bench_serve

    bp = bsub.add_parser("serve", help="load-test any OpenAI-compatible server over HTTP",
                         formatter_class=_FMT)
    bench_serve.add_serve_args(bp)
    bp.set_defaults(func=lambda a: (bench_serve.main_serve(a), 0)[1])
    from tinyvllm.benchmarks import throughput as bench_tp

    bp = bsub.add_parser("throughput", help="offline throughput of the engine in-process", formatter_class=_FMT)
    add_engine_args(bp)
    bench_tp.add_throughput_args(bp)
    bp.set_defaults(func=lambda a: (bench_tp.main_throughput(a, engine_kwargs(a)), 0)[1])
    bp = bsub.add_parser("latency", help="prefill and decode speed of the engine in-process",
                         formatter_class=_FMT)
    add_engine_args(bp)
    bench_tp.add_latency_args(bp)
    bp.set_defaults(func=lambda a: (bench_tp.main_latency(a, engine_kwargs(a)), 0)[1])

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tinyvllm.config import resolve_device
    from tinyvllm.model.loader import ModelNotFoundError

    if getattr(args, "device", None) is not None:
        try:  # before any process starts or weights load: one clear line, not an engine traceback
            resolve_device(args.device)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    try:
        return int(args.func(args) or 0)
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
