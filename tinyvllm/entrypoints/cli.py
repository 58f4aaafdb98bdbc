"""Command line: ``tinyvllm serve | generate | chat | bench``.

The engine flags are made by :class:`tinyvllm.config.EngineArgs`. Building the parser imports neither the
server nor the benchmarks: ``bench``'s subcommands are built only when ``bench`` is the command.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from tinyvllm.config import EngineArgs
from tinyvllm.entrypoints.openai.cli_args import add_server_args, flag_message


_FMT = argparse.ArgumentDefaultsHelpFormatter  # every subcommand's --help shows the defaults


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


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return vars(EngineArgs.from_cli_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.llm import LLM

    llm = LLM(**_engine_kwargs(args))
    _stream(llm.llm_engine, args.prompt, _sampling(args))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.llm import LLM

    llm = LLM(**_engine_kwargs(args))
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
    from tinyvllm.entrypoints.openai.launcher import run_server

    return run_server(args) or 0


def _llm_class() -> type:
    from tinyvllm.entrypoints.llm import LLM

    return LLM


def _add_bench_commands(p: argparse.ArgumentParser) -> None:
    from tinyvllm.benchmarks import prefill as bench_prefill
    from tinyvllm.benchmarks import serve as bench_serve
    from tinyvllm.benchmarks import throughput as bench_tp

    bsub = p.add_subparsers(dest="bench_command", required=True)
    bp = bsub.add_parser("serve", help="load-test any OpenAI-compatible server over HTTP",
                         formatter_class=_FMT)
    bench_serve.add_serve_args(bp)
    bp.set_defaults(func=lambda a: (bench_serve.main_serve(a), 0)[1])
    bp = bsub.add_parser("throughput", help="offline throughput of the engine in-process", formatter_class=_FMT)
    EngineArgs.add_cli_args(bp)
    bench_tp.add_throughput_args(bp)
    bp.set_defaults(func=lambda a: (bench_tp.main_throughput(a, EngineArgs.from_cli_args(a), _llm_class()), 0)[1])
    from tinyvllm.benchmarks import structured as bench_so

    bp = bsub.add_parser("structured", help="structured outputs: validity, bitmask overhead, compile stall",
                         formatter_class=_FMT)
    EngineArgs.add_cli_args(bp)
    bench_so.add_structured_args(bp)
    bp.set_defaults(func=lambda a: (bench_so.main_structured(a, EngineArgs.from_cli_args(a), _llm_class()), 0)[1])
    bp = bsub.add_parser("latency", help="prefill and decode speed of the engine in-process",
                         formatter_class=_FMT)
    EngineArgs.add_cli_args(bp)
    bench_tp.add_latency_args(bp)
    bp.set_defaults(func=lambda a: (bench_tp.main_latency(a, EngineArgs.from_cli_args(a), _llm_class()), 0)[1])
    bp = bsub.add_parser("prefill", help="one long-context prefill chunk (or decode) step, attention GFLOP/s",
                         formatter_class=_FMT)
    bench_prefill.add_prefill_args(bp)
    bp.set_defaults(func=lambda a: (bench_prefill.main_prefill(a), 0)[1])
    from tinyvllm.benchmarks import agent as bench_agent

    bp = bsub.add_parser("agent", help="the multi-turn agent workload in-process: TTFT per turn, prefix-cache hits",
                         formatter_class=_FMT)
    EngineArgs.add_cli_args(bp)
    bench_agent.add_agent_args(bp)
    bp.set_defaults(func=lambda a: (bench_agent.main_agent(a, EngineArgs.from_cli_args(a), _llm_class()), 0)[1])


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``tinyvllm`` parser for ``argv`` (default ``sys.argv[1:]``): ``bench``'s subcommands (and the
    benchmark modules) only when ``argv``'s command is ``bench``."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level has no valued options
    from tinyvllm import __version__

    parser = argparse.ArgumentParser(prog="tinyvllm", description="tinyvllm: LLM inference engine and server")
    parser.add_argument("--version", action="version", version=f"tinyvllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=_FMT)
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate from one prompt and print the text as it streams",
                       formatter_class=_FMT)
    p.add_argument("prompt")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal (streams tokens)", formatter_class=_FMT)
    p.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="benchmarks", formatter_class=_FMT)
    if command == "bench":
        _add_bench_commands(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tinyvllm.config import check_device_name, resolve_device
    from tinyvllm.model.loader import ModelNotFoundError

    if getattr(args, "device", None) is not None:
        try:  # before any process starts or weights load: one clear line, not an engine traceback
            # "auto" and "cpu" always resolve; only a CUDA device can be missing, and looking imports
            # torch (1-2 s), which `serve` must not do before it has spawned the engine core
            if check_device_name(args.device).startswith("cuda"):
                resolve_device(args.device)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command in ("generate", "chat"):  # (serve checks its options itself, with the server's)
        try:  # a bad option is one line now, not a traceback from the engine
            EngineArgs.from_cli_args(args).create_engine_config()
        except (TypeError, ValueError) as e:
            print(f"error: {flag_message(str(e))}", file=sys.stderr)
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
