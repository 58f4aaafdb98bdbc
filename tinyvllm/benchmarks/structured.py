"""``tinyvllm bench structured``: grammar-constrained decoding, in-process.

Three figures (issue 13):

1. **validity**: ``--num-prompts`` varied prompts x 3 JSON schemas (a nested object; enums and integer
   ranges; an array with ``minItems``), all sent at once: the share of outputs that parse as JSON and
   validate against their schema (``jsonschema``).
2. **overhead**: the mean decode-step time of a batch of ``--batch-size`` requests with every row
   constrained (a JSON array of integers: the grammar never lets a row finish early) against the same
   batch unconstrained (``ignore_eos``). The constrained step includes filling the bitmask (xgrammar,
   in the step loop) and applying it to the logits.
3. **compile stall**: the inter-token latency (ITL) of one unconstrained request while the grammar of
   a 40-tool ``tool_choice="required"`` request compiles in the background thread, against its ITL
   without a compile (``--compile-rounds`` compiles, each with fresh tool names so no cache hit).

Prints tables; ``--result-file`` writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams
from tinyvllm.structured_output.tools import tool_structural_tag

if TYPE_CHECKING:
    from tinyvllm.config import EngineArgs

SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object", "additionalProperties": False, "required": ["name", "address", "tags"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                        "properties": {"city": {"type": "string", "maxLength": 30},
                                       "country": {"type": "string", "maxLength": 30}}},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}}}},
    "enum_and_ranges": {
        "type": "object", "additionalProperties": False, "required": ["category", "rating", "year"],
        "properties": {
            "category": {"type": "string", "enum": ["food", "travel", "science", "sport", "art", "other"]},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}},
    "array_min_items": {
        "type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "quantity"],
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 100}}}}}},
}
_SUBJECTS = [
    "a bakery in Lyon", "the planet Mars", "a football club", "a jazz album", "a mountain hike", "a sushi bar",
    "a chemistry lab", "a marathon", "an oil painting", "a train journey", "a coffee shop", "a volcano",
    "a tennis match", "a sculpture", "a ski resort", "a pizza", "a telescope", "a cycling race", "a museum",
    "a beach holiday", "a vegan cafe", "a black hole", "a chess tournament", "a photograph", "a road trip",
    "a noodle soup", "a microscope", "a swimming pool", "a theatre play", "a desert safari", "a cheese shop",
    "a rainforest", "a basketball game", "a poem", "a city break", "a curry house", "a robot", "a rowing boat",
    "a comic book", "a lighthouse", "a farmers market", "an eclipse", "a golf course", "a film festival",
    "an island", "a taco stand", "a satellite", "a climbing wall", "a violin concert", "a castle",
]
_ASKS = {
    "nested_object": "Describe {s}: give it a name, an address (city and country) and up to three tags, as JSON.",
    "enum_and_ranges": "Classify {s}: a category, a rating from 1 to 5 and a year, as JSON.",
    "array_min_items": "List two to four things to buy for {s}, each with a quantity, as JSON.",
}


def add_structured_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=50, help="prompts per schema (validity)")
    p.add_argument("--max-tokens", type=int, default=200, help="output limit of the validity requests")
    p.add_argument("--batch-size", type=int, default=16, help="decode batch of the overhead figure")
    p.add_argument("--decode-steps", type=int, default=48, help="tokens per request of the overhead figure")
    p.add_argument("--num-tools", type=int, default=40, help="tools in the compile-stall request")
    p.add_argument("--compile-rounds", type=int, default=3, help="compiles timed for the stall figure")
    p.add_argument("--skip", nargs="*", default=[], choices=["validity", "overhead", "stall"],
                   help="figures not to measure")
    p.add_argument("--result-file", default=None, help="write the result as JSON here")


def _chat_ids(eng: Any, text: str) -> list[int]:
    return eng.chat_prompt_ids([{"role": "user", "content": text}])


def run_validity(llm: Any, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Generate ``num_prompts`` x 3 constrained outputs (greedy) at once; parse and validate each."""
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - a test dependency
        raise SystemExit("bench structured needs jsonschema (pip install jsonschema)") from e
    eng = llm.llm_engine
    prompts, params, kinds = [], [], []
    for kind, schema in SCHEMAS.items():
        sp = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(json=schema))
        for i in range(num_prompts):
            prompts.append({"prompt_token_ids": _chat_ids(eng, _ASKS[kind].format(s=_SUBJECTS[i % len(_SUBJECTS)]))})
            params.append(sp)
            kinds.append(kind)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    per: dict[str, dict[str, int]] = {k: {"n": 0, "valid": 0, "length": 0} for k in SCHEMAS}
    failures = []
    for kind, o in zip(kinds, outs):
        c = o.outputs[0]
        per[kind]["n"] += 1
        per[kind]["length"] += c.finish_reason == "length"
        try:
            jsonschema.validate(json.loads(c.text), SCHEMAS[kind])
            per[kind]["valid"] += 1
        except Exception as e:  # noqa: BLE001 - counted as a failure
            failures.append({"schema": kind, "text": c.text[:200], "finish_reason": c.finish_reason,
                             "error": str(e).splitlines()[0][:200]})
    total = sum(v["n"] for v in per.values())
    valid = sum(v["valid"] for v in per.values())
    return {"per_schema": per, "total": total, "valid": valid, "valid_pct": 100.0 * valid / total,
            "seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "failures": failures[:10]}


def _decode_steps(eng: Any, prompts: list[list[int]], params: list[SamplingParams], batch: int) -> list[float]:
    """Run to completion; the times (s) of the steps that decoded exactly ``batch`` rows, no prefill."""
    for p, sp in zip(prompts, params):
        eng.add_request({"prompt_token_ids": p}, sp)
    steps = []
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        eng.step()
        te = time.perf_counter()
        it = eng.core.last_iteration
        if it.num_prefill_tokens == 0 and it.num_decode_tokens == batch:
            steps.append(te - ts)
    return steps


def run_overhead(llm: Any, batch: int, decode_steps: int, repeats: int = 2) -> dict[str, Any]:
    eng = llm.llm_engine
    prompts = [_chat_ids(eng, f"Write a long list of numbers, #{i}.") for i in range(batch)]
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                  "maximum": 100000},
                                       "minItems": 1000})
    free = SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True)
    bound = SamplingParams(temperature=0, max_tokens=decode_steps, structured_outputs=so)
    _decode_steps(eng, prompts[:2], [bound] * 2, 2)  # warm-up, and the compile (cached afterwards)
    res: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(repeats):  # interleaved, the median of each: the machine is shared
        for name, sp in (("unconstrained", free), ("constrained", bound)):
            res[name] += _decode_steps(eng, prompts, [sp] * batch, batch)
    med = {k: statistics.median(v) if v else float("nan") for k, v in res.items()}
    mean = {k: statistics.fmean(v) if v else float("nan") for k, v in res.items()}
    return {"batch_size": batch, "num_steps": {k: len(v) for k, v in res.items()},
            "median_step_ms": {k: v * 1000 for k, v in med.items()},
            "mean_step_ms": {k: v * 1000 for k, v in mean.items()},
            "ratio_median": med["constrained"] / med["unconstrained"],
            "ratio_mean": mean["constrained"] / mean["unconstrained"]}


def run_mask_cost(llm: Any, batch: int, reps: int = 30) -> dict[str, Any]:
    """The work a constrained decode step adds, timed alone (the minimum over ``reps``, robust to a
    loaded machine): filling ``batch`` rows of the bitmask (xgrammar, JSON-array grammars mid-output)
    and masking ``[batch, vocab]`` float32 logits with it."""
    import numpy as np
    import torch

    from tinyvllm.sample.sampler import apply_token_bitmask

    mgr = llm.llm_engine.core.structured_output_manager
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                  "maximum": 100000}, "minItems": 1000})
    grammars = [mgr.grammar_for(so, [0]) for _ in range(batch)]
    for g in grammars:
        g.wait(600)
    tok = llm.llm_engine.tokenizer
    for i, g in enumerate(grammars):  # mid-output: "[12, 345, 6"
        for t in tok.encode(f"[{i}, 345, 6", add_special_tokens=False):
            g.accept_token(t)
    vocab = mgr.backend.vocab_size
    words = (vocab + 31) // 32
    fill, apply = [], []
    logits = torch.randn(batch, vocab)
    for _ in range(reps):
        t0 = time.perf_counter()
        bm = np.full((batch, words), -1, dtype=np.int32)
        for i, g in enumerate(grammars):
            g.fill_bitmask(bm, i)
        t1 = time.perf_counter()
        apply_token_bitmask(logits.clone(), torch.from_numpy(bm), torch.arange(batch))
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
    return {"batch_size": batch, "fill_bitmask_ms": min(fill) * 1000, "apply_bitmask_ms": min(apply) * 1000,
            "total_ms": (min(fill) + min(apply)) * 1000}


def _tools(n: int, tag: str) -> list[dict]:
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 1000},
             {"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 5}]
    tools = []
    for i in range(n):
        props = {f"arg_{j}_{tag}": kinds[(i + j) % len(kinds)] for j in range(3 + i % 4)}
        tools.append({"type": "function", "function": {
            "name": f"tool_{tag}_{i}", "description": f"tool number {i}",
            "parameters": {"type": "object", "properties": props, "required": list(props)[:2],
                           "additionalProperties": False}}})
    return tools


def _p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def run_compile_stall(llm: Any, num_tools: int, rounds: int) -> dict[str, Any]:
    """ITLs (s) of an unconstrained stream: a baseline stretch, then while each compile runs."""
    eng = llm.llm_engine
    core = eng.core
    ids = _chat_ids(eng, "Tell me a very long story about a dragon.")
    warm = core.structured_output_manager.grammar_for(StructuredOutputsParams(regex="a"), [0])
    warm.wait(600)  # the backend (tokenizer, xgrammar's vocabulary tables) is built once, not timed here
    baseline: list[float] = []
    during: list[float] = []
    compile_s: list[float] = []
    for r in range(rounds):
        stream_id = eng.add_request({"prompt_token_ids": ids},
                                    SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        last = None

        def tick(into: list[float]) -> None:
            nonlocal last
            eng.step()
            now = time.perf_counter()
            if core.last_iteration.num_prefill_tokens == 0 and last is not None:
                into.append(now - last)
            last = now

        for _ in range(40):  # the stream in decode alone
            tick(baseline)
        tag = f"r{r}_{time.monotonic_ns() % 10**9}"  # fresh names: never a cache hit
        st = tool_structural_tag(_tools(num_tools, tag), "required", parallel=False)
        tool_id = eng.add_request({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(structural_tag=st)))
        grammar = core.scheduler.requests[tool_id].grammar
        t0 = time.perf_counter()
        while not grammar.ready:
            tick(during)
        compile_s.append(time.perf_counter() - t0)
        for rid in (stream_id, tool_id):
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    b99, d99 = _p99(baseline), _p99(during)
    return {"num_tools": num_tools, "rounds": rounds, "compile_s": compile_s,
            "baseline_itl_ms": {"p50": statistics.median(baseline) * 1000, "p99": b99 * 1000, "n": len(baseline)},
            "during_compile_itl_ms": {"p50": statistics.median(during) * 1000 if during else float("nan"),
                                      "p99": d99 * 1000, "n": len(during)},
            "p99_rise_ms": (d99 - b99) * 1000}


def main_structured(args: argparse.Namespace, engine_args: EngineArgs, make_llm: Callable[..., Any]
                    ) -> dict[str, Any]:
    engine_kwargs = dataclasses.asdict(engine_args)
    llm = make_llm(**engine_kwargs)
    res: dict[str, Any] = {"engine": engine_kwargs}
    if "validity" not in args.skip:
        v = res["validity"] = run_validity(llm, args.num_prompts, args.max_tokens)
        print(f"{'schema':>18} {'outputs':>8} {'valid':>6} {'length':>7}")
        for k, s in v["per_schema"].items():
            print(f"{k:>18} {s['n']:>8} {s['valid']:>6} {s['length']:>7}")
        print(f"{'all':>18} {v['total']:>8} {v['valid']:>6}   -> {v['valid_pct']:.1f}% parse and validate "
              f"({v['output_tokens']} tokens in {v['seconds']:.1f} s)")
    if "overhead" not in args.skip:
        o = res["overhead"] = run_overhead(llm, args.batch_size, args.decode_steps)
        print(f"decode step, batch {o['batch_size']}: unconstrained {o['median_step_ms']['unconstrained']:.2f} ms, "
              f"every row constrained {o['median_step_ms']['constrained']:.2f} ms (median; "
              f"ratio {o['ratio_median']:.3f}, mean ratio {o['ratio_mean']:.3f}; steps {o['num_steps']})")
        m = res["mask_cost"] = run_mask_cost(llm, args.batch_size)
        print(f"bitmask work per constrained step, batch {m['batch_size']} (min of 30): fill "
              f"{m['fill_bitmask_ms']:.2f} ms + apply {m['apply_bitmask_ms']:.2f} ms = {m['total_ms']:.2f} ms")
    if "stall" not in args.skip:
        s = res["stall"] = run_compile_stall(llm, args.num_tools, args.compile_rounds)
        print(f"{s['num_tools']}-tool grammar compile: {', '.join(f'{c:.2f}' for c in s['compile_s'])} s; "
              f"stream ITL p99 {s['baseline_itl_ms']['p99']:.1f} ms alone (n={s['baseline_itl_ms']['n']}), "
              f"{s['during_compile_itl_ms']['p99']:.1f} ms during compiles (n={s['during_compile_itl_ms']['n']}): "
              f"rise {s['p99_rise_ms']:.1f} ms")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"wrote {args.result_file}")
    return res
