"""``tinyvllm bench serve``: a load generator for any OpenAI-compatible server.

Like ``vllm bench serve``: it streams completions (``/v1/completions``, or
``/v1/chat/completions`` with ``--endpoint``) over SSE with
``stream_options.include_usage``, and measures per request TTFT, every
inter-token latency, TPOT and end-to-end latency; prompt, output and cached
token counts come from the server's final ``usage`` chunk. See
:mod:`tinyvllm.benchmarks.metrics` for the exact definitions (notably: a chunk
that carries several tokens counts as one ITL arrival).

Load shaping: ``--max-concurrency`` (a semaphore on in-flight requests),
``--request-rate`` (Poisson arrivals: exponential gaps from an RNG seeded by
``--seed``; ``inf`` sends everything at once), ``--num-prompts`` (bound on the
number of requests) and ``--duration`` (no new request is issued after that
many seconds; requests in flight finish).

The agent workload runs ``--sessions`` sessions concurrently; the turns of one
session are sequential. Each turn sends the whole history as one prompt string
(to ``/v1/completions`` by default, so any server works); the model's actual
returned text is appended to the history, then, after ``--think-time`` seconds
(the tool "running"), the tool result. With ``--request-rate`` the *sessions*
start at Poisson arrival times. A failed turn ends its session.

Programmatic use::

    result = asyncio.run(run_benchmark("http://127.0.0.1:8000", "model", specs,
                                       max_concurrency=8))
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from datetime import datetime
from typing import Any, Sequence

import httpx

from tinyvllm.benchmarks import datasets as ds
from tinyvllm.benchmarks.metrics import RequestRecord, compute_metrics, per_turn_stats

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_ENDPOINT_ALIASES = {"completions": COMPLETIONS, "chat": CHAT, "chat-completions": CHAT}

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


# --------------------------------------------------------------- arrivals


def _arrival_rng(seed: int) -> random.Random:
    return random.Random(f"arrivals:{seed}")


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Planned issue times (seconds after start) of the first ``n`` requests.

    The first request goes at 0; the gaps are exponential with mean
    ``1/request_rate`` (a Poisson process). ``inf`` means all at 0. This is
    exactly the schedule :func:`run_benchmark` follows for the same seed.
    """
    rng = _arrival_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        if i > 0 and math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        out.append(t)
    return out


def normalize_endpoint(endpoint: str) -> str:
    endpoint = _ENDPOINT_ALIASES.get(endpoint, endpoint)
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    return endpoint


def _is_chat(endpoint: str) -> bool:
    return "chat" in endpoint


# --------------------------------------------------------------- one request


def build_body(
    model: str,
    prompt: ds.Prompt,
    max_tokens: int,
    *,
    chat: bool,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    extra_body: dict | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        if not isinstance(prompt, str):
            raise ValueError("token-id prompts need the completions endpoint")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/tinyvllm extra field
    if extra_body:
        body.update(extra_body)
    return body


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (
            delta.get("reasoning_content") or delta.get("reasoning") or ""
        )
    return c.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    *,
    chat: bool,
    headers: dict[str, str] | None = None,
    t0: float = 0.0,
) -> RequestRecord:
    """POST one streaming request and fill ``record``; never raises."""
    pieces: list[str] = []
    usage: dict | None = None
    last_arrival: float | None = None
    start = time.perf_counter()
    record.start_time = start - t0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            record.status_code = resp.status_code
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {detail[:500]}"
            else:
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line or line.startswith(":") or not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        err = chunk["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        record.error = f"stream error: {msg}"
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    text = _chunk_text(chunk, chat)
                    if text:
                        if last_arrival is None:
                            record.ttft = now - start
                        else:
                            record.itl.append(now - last_arrival)
                        last_arrival = now
                        record.num_chunks += 1
                        pieces.append(text)
    except Exception as e:  # connection refused, timeout, bad JSON, ...
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    record.e2e = time.perf_counter() - start
    record.generated_text = "".join(pieces)
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
    else:
        record.output_tokens = record.num_chunks
    record.success = not record.error
    if record.success and record.ttft is not None and record.output_tokens > 1:
        record.tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
    return record


# --------------------------------------------------------------- the runner


class _Runner:
    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        model: str,
        *,
        chat: bool,
        max_concurrency: int | None,
        duration: float | None,
        max_requests: int | None,
        temperature: float,
        ignore_eos: bool,
        extra_body: dict | None,
        headers: dict[str, str],
        pbar: Any,
        agent_tool_calls: bool = False,
    ):
        self.client, self.url, self.model, self.chat = client, url, model, chat
        self.sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.duration = duration
        self.max_requests = max_requests
        self.temperature, self.ignore_eos, self.extra_body = temperature, ignore_eos, extra_body
        self.headers = headers
        self.pbar = pbar
        # Agent turns answered by a grammar-constrained JSON tool call (structured_outputs.json).
        self.tool_call_body = {"structured_outputs": {"json": ds.tool_call_schema()}} if agent_tool_calls else None
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()

    def may_issue(self) -> bool:
        if self.duration is not None and time.perf_counter() - self.t0 >= self.duration:
            return False
        return self.max_requests is None or len(self.records) < self.max_requests

    async def issue(self, prompt: ds.Prompt, max_tokens: int, extra: dict | None = None,
                    **meta: Any) -> RequestRecord | None:
        """Send one request (after the concurrency gate); None if not sent. ``extra``: body fields of
        this request only."""
        if self.sem is not None:
            async with self.sem:
                return await self._issue(prompt, max_tokens, extra, **meta)
        return await self._issue(prompt, max_tokens, extra, **meta)

    async def _issue(self, prompt: ds.Prompt, max_tokens: int, extra: dict | None = None,
                     **meta: Any) -> RequestRecord | None:
        if not self.may_issue():
            return None
        rec = RequestRecord(request_id=len(self.records), max_tokens=max_tokens, **meta)
        self.records.append(rec)
        body = build_body(
            self.model,
            prompt,
            max_tokens,
            chat=self.chat,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            extra_body={**(self.extra_body or {}), **(extra or {})} or None,
        )
        await send_request(
            self.client, self.url, body, rec, chat=self.chat, headers=self.headers, t0=self.t0
        )
        if self.pbar is not None:
            self.pbar.update(1)
        return rec

    async def paced(self, n: int, request_rate: float, seed: int, fn) -> None:
        """Start ``fn(i)`` for i < n at Poisson arrival times; await them all."""
        rng = _arrival_rng(seed)
        target = 0.0
        tasks = []
        for i in range(n):
            if i > 0 and math.isfinite(request_rate):
                target += rng.expovariate(request_rate)
                delay = self.t0 + target - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if not self.may_issue():
                break
            tasks.append(asyncio.create_task(fn(i)))
        if tasks:
            await asyncio.gather(*tasks)

    async def run_flat(self, specs: Sequence[ds.RequestSpec], request_rate: float, seed: int) -> None:
        async def one(i: int) -> None:
            s = specs[i]
            await self.issue(
                s.prompt,
                s.max_tokens,
                prompt_len=s.prompt_len,
                session_id=s.session_id,
                turn=s.turn,
                group_id=s.group_id,
            )

        await self.paced(len(specs), request_rate, seed, one)

    async def run_agent(self, wl: ds.AgentWorkload, request_rate: float, seed: int) -> None:
        async def session(i: int) -> None:
            sess = wl.sessions[i]
            history = sess.prefix
            for t in range(sess.num_turns):
                prompt = history + sess.user_block(t)
                rec = await self.issue(
                    prompt, sess.max_tokens, self.tool_call_body, session_id=sess.session_id, turn=t,
                    prompt_len=None,
                )
                if rec is None or not rec.success:
                    return
                if self.tool_call_body is not None:
                    rec.tool_call_valid = ds.is_valid_tool_call(rec.generated_text)
                history = prompt + rec.generated_text
                if t + 1 < sess.num_turns:
                    await asyncio.sleep(wl.think_time)  # the tool runs
                    history += sess.tool_block(t)

        await self.paced(len(wl.sessions), request_rate, seed, session)


async def run_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[ds.RequestSpec] | ds.AgentWorkload,
    *,
    endpoint: str = COMPLETIONS,
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
    duration: float | None = None,
    num_prompts: int | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    extra_body: dict | None = None,
    api_key: str | None = None,
    request_timeout: float = 600.0,
    disable_tqdm: bool = True,
    agent_tool_calls: bool = False,
) -> dict[str, Any]:
    """Run one benchmark; returns metrics + config + per-request records.

    ``requests`` is a list of :class:`RequestSpec` (flat workloads) or an
    :class:`AgentWorkload`. ``num_prompts`` bounds the number of requests
    issued (default: all of them); ``duration`` stops issuing after that many
    seconds.
    """
    endpoint = normalize_endpoint(endpoint)
    chat = _is_chat(endpoint)
    url = base_url.rstrip("/") + endpoint
    agent = isinstance(requests, ds.AgentWorkload)
    total = requests.num_requests if agent else len(requests)
    if num_prompts is not None:
        total = min(total, num_prompts)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    pbar = None
    if not disable_tqdm:
        from tqdm.asyncio import tqdm

        pbar = tqdm(total=total, desc="requests")
    # trust_env=False: never route benchmark traffic through an env proxy.
    timeout = httpx.Timeout(request_timeout, connect=min(request_timeout, 30.0))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or 256)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        runner = _Runner(
            client,
            url,
            model,
            chat=chat,
            max_concurrency=max_concurrency,
            duration=duration,
            max_requests=num_prompts,
            temperature=temperature,
            ignore_eos=ignore_eos,
            extra_body=extra_body,
            headers=headers,
            pbar=pbar,
            agent_tool_calls=agent and agent_tool_calls,
        )
        if agent:
            await runner.run_agent(requests, request_rate, seed)
        else:
            await runner.run_flat(requests, request_rate, seed)
        elapsed = time.perf_counter() - runner.t0
    if pbar is not None:
        pbar.close()

    records = sorted(runner.records, key=lambda r: r.request_id)
    ends = [r.start_time + r.e2e for r in records if r.e2e is not None]
    bench_duration = max(ends) if ends else elapsed
    result: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "base_url": base_url,
        "endpoint": endpoint,
        "model": model,
        "workload": "agent" if agent else "flat",
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "duration_limit": duration,
        "num_prompts": num_prompts,
        "seed": seed,
        "temperature": temperature,
    }
    result.update(compute_metrics(records, bench_duration))
    if agent:
        result["per_turn"] = per_turn_stats(records)
        calls = [r.tool_call_valid for r in records if r.tool_call_valid is not None]
        if calls:
            result["tool_calls"] = {"answered": len(calls), "valid": sum(calls)}
    result["requests"] = [r.to_dict() for r in records]
    return result


# --------------------------------------------------------------- CLI glue


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=DEFAULT_MODEL, help="model name sent in the request body")
    g.add_argument(
        "--endpoint",
        default=COMPLETIONS,
        help="/v1/completions or /v1/chat/completions ('completions'/'chat' also accepted)",
    )
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random", "shared-prefix", "agent", "agent-editing"], default="random",
                   help="agent-editing: a file read by a tool call, then rewritten with a small edit "
                        "(speculative decoding's workload; tinyvllm/benchmarks/agent_editing.py)")
    g.add_argument(
        "--prompt-format",
        choices=["text", "token-ids"],
        default="text",
        help="text: words (~1 token each); token-ids: lists of ids (completions only; not agent)",
    )
    g.add_argument("--vocab-size", type=int, default=32000, help="token-ids are drawn below this")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-prompts", type=int, default=None,
                   help="number of requests (random/shared-prefix default 100; agent: sessions*turns)")
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens (none: random 128, shared-prefix 64, agent 30)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: draw lengths uniformly from [L*(1-r), L*(1+r)]")
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix: number of prefixes")
    g.add_argument("--prefix-len", type=int, default=1000,
                   help="shared-prefix/agent: system prompt + tool definitions tokens")
    g.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: distinct suffix tokens")
    g.add_argument("--sessions", type=int, default=4, help="agent: concurrent sessions")
    g.add_argument("--turns", type=int, default=5, help="agent: turns per session")
    g.add_argument("--user-len", type=int, default=30, help="agent: user message tokens per turn")
    g.add_argument("--tool-result-len", type=int, default=300, help="agent: tool result tokens")
    g.add_argument("--agent-tool-calls", action="store_true",
                   help="agent: each answer is a JSON tool call constrained by a grammar (sent as vLLM's "
                        "structured_outputs.json; the run reports how many parse and follow the schema)")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="agent: seconds between an answer and the next turn (tool runtime)")

    g = parser.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (agent: session starts/s); inf = all at once")
    g.add_argument("--duration", type=float, default=None, help="stop issuing new requests after N s")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos=true")
    g.add_argument("--extra-body", type=str, default=None, help="JSON merged into every request body")

    g = parser.add_argument_group("output")
    g.add_argument("--result-dir", default=None, help="save JSON (+ plots) here")
    g.add_argument("--result-file", default=None, help="JSON file name (in --result-dir if given)")
    g.add_argument("--label", default=None, help="label stored in the result (legend of plots)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")


_OUTPUT_DEFAULTS = {"random": 128, "shared-prefix": 64, "agent": 30, "agent-editing": 128}


def build_dataset(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    output_len = args.output_len if args.output_len is not None else _OUTPUT_DEFAULTS[args.dataset]
    if args.dataset == "agent":
        wl = ds.agent_dataset(
            sessions=args.sessions,
            turns=args.turns,
            prefix_len=args.prefix_len,
            user_len=args.user_len,
            output_len=output_len,
            tool_result_len=args.tool_result_len,
            think_time=args.think_time,
            seed=args.seed,
        )
        return wl, dict(wl.meta)
    num = args.num_prompts if args.num_prompts is not None else 100
    if args.dataset == "agent-editing":
        from tinyvllm.benchmarks.agent_editing import agent_editing_dataset

        specs = agent_editing_dataset(num, output_len, seed=args.seed)
        return specs, dict(output_len=output_len, prompt_format="text")
    if args.dataset == "random":
        specs = ds.random_dataset(
            num, args.input_len, output_len, range_ratio=args.range_ratio, seed=args.seed,
            prompt_format=args.prompt_format, vocab_size=args.vocab_size,
        )
        meta = dict(input_len=args.input_len, output_len=output_len, range_ratio=args.range_ratio)
    else:
        specs = ds.shared_prefix_dataset(
            num, args.num_groups, args.prefix_len, args.suffix_len, output_len, seed=args.seed,
            prompt_format=args.prompt_format, vocab_size=args.vocab_size,
        )
        meta = dict(num_groups=args.num_groups, prefix_len=args.prefix_len,
                    suffix_len=args.suffix_len, output_len=output_len)
    meta["prompt_format"] = args.prompt_format
    return specs, meta


def _result_stem(args: argparse.Namespace) -> str:
    conc = args.max_concurrency if args.max_concurrency else "inf"
    rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate:g}"
    model = os.path.basename(str(args.model).rstrip("/")) or "model"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{args.dataset}-{model}-c{conc}-r{rate}-{stamp}"


def fetch_metrics(base_url: str, api_key: str | None = None) -> str | None:
    """The server's ``/metrics`` text, or None where it has none (not reachable, not 200). ``bench serve``
    reads it once before and once after a run; the ``parse_*`` functions below take it (or None)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10, trust_env=False)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


_MISS_REASON_RE = r'^tinyvllm:prefix_cache_miss_reason_total\{[^}]*reason="([^"]+)"[^}]*\}\s+(\S+)$'


def parse_miss_reasons(text: str | None) -> dict[str, float] | None:
    """The prefix-cache miss-reason counters in a ``/metrics`` text (tinyvllm's), or None where it has none."""
    import re

    if text is None:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(_MISS_REASON_RE, line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out or None


def format_miss_reasons(before: dict[str, float] | None, after: dict[str, float] | None) -> str | None:
    """One line: prompts of this run by prefix-cache miss reason (the counters' increase), or None."""
    if after is None:
        return None
    before = before or {}
    delta = {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items())}
    total = sum(delta.values())
    parts = ", ".join(f"{k} {v}" for k, v in delta.items() if v)
    return f"prefix-cache miss reasons ({total} prompts): {parts or 'none'}"


_SPEC_RE = r'^tinyvllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens)_total\{[^}]*\}\s+(\S+)$'


def parse_spec_counters(text: str | None) -> dict[str, float] | None:
    """The speculative-decoding counters (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``) in a
    ``/metrics`` text (tinyvllm's), or None where it has none."""
    import re

    if text is None:
        return None
    out = {m.group(1): float(m.group(2)) for m in (re.match(_SPEC_RE, ln) for ln in text.splitlines()) if m}
    return out or None


_CACHE_INFO_RE = r'^(?:tinyvllm|vllm):cache_config_info\{([^}]*)\}\s+\S+$'


def parse_cache_config(text: str | None) -> dict[str, Any] | None:
    """The KV pool in a ``/metrics`` text: ``cache_config_info``'s ``block_size``, ``cache_dtype`` and
    ``num_gpu_blocks`` labels (tinyvllm's, or vLLM's of the same name), or None where it has none."""
    import re

    if text is None:
        return None
    for ln in text.splitlines():
        m = re.match(_CACHE_INFO_RE, ln)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            try:
                return {"block_size": int(labels["block_size"]), "cache_dtype": labels.get("cache_dtype", "?"),
                        "num_blocks": int(labels["num_gpu_blocks"])}
            except (KeyError, ValueError):
                return None
    return None


def kv_pool_summary(cache: dict[str, Any] | None, requests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How many sessions like this run's longest the server's KV pool holds at once: ``num_blocks //
    ceil(L / block_size)`` with ``L`` the largest prompt + output tokens of one request (an agent
    session's last turn carries its whole history), each running session owning its blocks (no prefix
    sharing counted). None without the pool's configuration or a completed request."""
    lens = [(r.get("prompt_tokens") or 0) + (r.get("output_tokens") or 0) for r in requests if r.get("success")]
    if cache is None or not lens or max(lens) <= 0:
        return None
    longest = max(lens)
    per_session = -(-longest // cache["block_size"])
    return {**cache, "tokens": cache["num_blocks"] * cache["block_size"], "longest_session_tokens": longest,
            "sessions_per_pool": cache["num_blocks"] // per_session}


def spec_decode_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The run's speculative decoding (the counters' increase): drafts, draft / accepted tokens, the
    acceptance rate (accepted / draft tokens) and the mean accepted length (tokens per verification
    step: 1 + accepted / drafts, vLLM's definition); None without counters or drafts."""
    if after is None:
        return None
    before = before or {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    if d["num_drafts"] <= 0:
        return None
    return {"num_drafts": int(d["num_drafts"]), "num_draft_tokens": int(d["num_draft_tokens"]),
            "num_accepted_tokens": int(d["num_accepted_tokens"]),
            "acceptance_rate": d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
            "mean_accepted_length": 1 + d["num_accepted_tokens"] / d["num_drafts"]}


def main_serve(args: argparse.Namespace) -> dict[str, Any]:
    from tinyvllm.benchmarks import report

    endpoint = normalize_endpoint(args.endpoint)
    if args.prompt_format == "token-ids" and (_is_chat(endpoint) or args.dataset == "agent"):
        raise SystemExit("--prompt-format token-ids needs --endpoint /v1/completions and a non-agent dataset")
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise SystemExit("--extra-body must be a JSON object")
    requests, meta = build_dataset(args)

    metrics_before = fetch_metrics(args.base_url, args.api_key)
    reasons_before, spec_before = parse_miss_reasons(metrics_before), parse_spec_counters(metrics_before)
    result = asyncio.run(
        run_benchmark(
            args.base_url,
            args.model,
            requests,
            endpoint=endpoint,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            duration=args.duration,
            num_prompts=args.num_prompts,
            seed=args.seed,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            extra_body=extra_body,
            api_key=args.api_key,
            request_timeout=args.request_timeout,
            disable_tqdm=args.disable_tqdm,
            agent_tool_calls=getattr(args, "agent_tool_calls", False),
        )
    )
    # Put dataset info before the metrics for readability.
    head = {"dataset": args.dataset, "dataset_args": meta, "label": args.label}
    result = {**head, **result}
    metrics_after = fetch_metrics(args.base_url, args.api_key)
    reasons_after = parse_miss_reasons(metrics_after)
    if reasons_after is not None:
        result["prefix_cache_miss_reasons"] = {k: int(v - (reasons_before or {}).get(k, 0.0))
                                               for k, v in reasons_after.items()}
    spec = spec_decode_summary(spec_before, parse_spec_counters(metrics_after))
    if spec is not None:
        result["spec_decode"] = spec
    pool = kv_pool_summary(parse_cache_config(metrics_after), result.get("requests", []))
    if pool is not None:
        result["kv_pool"] = pool
    print(report.format_table(result))
    line = format_miss_reasons(reasons_before, reasons_after)
    if line:
        print(line)
    if spec is not None:
        print(f"speculative decoding: acceptance rate {100 * spec['acceptance_rate']:.1f}% "
              f"({spec['num_accepted_tokens']}/{spec['num_draft_tokens']} draft tokens), "
              f"mean accepted length {spec['mean_accepted_length']:.2f} tokens per step ({spec['num_drafts']} drafts)")
    if pool is not None:
        print(f"KV pool: {pool['num_blocks']} blocks x {pool['block_size']} tokens ({pool['cache_dtype']}) = "
              f"{pool['tokens']} tokens: {pool['sessions_per_pool']} sessions of this run's longest "
              f"({pool['longest_session_tokens']} tokens) at once")
    if result["completed"] == 0 and result["requests"]:
        print(f"first error: {result['requests'][0]['error']}", file=sys.stderr)

    if args.result_dir or args.result_file:
        stem = _result_stem(args)
        name = args.result_file or stem + ".json"
        path = os.path.join(args.result_dir, name) if args.result_dir else name
        report.save_json(result, path)
        print(f"saved {path}")
        if not args.no_plot:
            for p in report.save_plots(result, os.path.splitext(path)[0]):
                print(f"saved {p}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Benchmark an OpenAI-compatible server.")
    add_serve_args(parser)
    return main_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
