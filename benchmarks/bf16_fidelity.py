#!/usr/bin/env python3
"""bf16 fidelity of the default model against transformers' float32 (issue 37).

    # once: transformers' float32 and bfloat16 greedy outputs on the same GGUF -> the test's reference file
    .venv/bin/python benchmarks/bf16_fidelity.py refs [--out tests/data/bf16_fidelity.json]
    # tinyvllm against them (one row per kernel choice, see set_path)
    .venv/bin/python benchmarks/bf16_fidelity.py compare [--quantization gguf] [--paths default,r,ag]
    # the attention kernels alone on the model's real queries and caches, against float64
    .venv/bin/python benchmarks/bf16_fidelity.py attention

Per chat prompt (greedy, ``NUM_TOKENS`` tokens, EOS ignored): whether the whole output equals float32's,
and the length of the common prefix with it. ``compare`` also prints a continuous figure, far less noisy
than greedy agreement: teacher-forced along float32's continuation (``prompt_logprobs``), the mean
absolute difference of each continuation token's log-probability from float32's, in nats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NUM_TOKENS = 32
DEFAULT_REFS = ROOT / "tests" / "data" / "bf16_fidelity.json"
sys.path.insert(0, str(ROOT / "benchmarks"))
from gguf_quality import PROMPTS as QUALITY_PROMPTS  # noqa: E402  (tests/conftest.py's 6 and 14 more)

# 24 chat prompts: the 20 of benchmarks/gguf_quality.py (the table) and 4 more.
PROMPTS = QUALITY_PROMPTS + [
    "How do plants make their food?",
    "Give two tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Write a short greeting for a birthday card.",
]


# A larger set for comparisons that 24 prompts cannot resolve (``refs --templated N``): templates x topics.
TEMPLATES = ["Explain {} in one sentence.", "Write a haiku about {}.", "Give three facts about {}.",
             "What is the history of {}? Answer briefly.", "Write a short poem about {}.",
             "Why do people like {}?", "Describe {} to a child.", "List two pros and two cons of {}."]
TOPICS = ["the moon", "coffee", "volcanoes", "the internet", "honeybees", "chess", "the ocean", "bicycles",
          "rainbows", "democracy", "penguins", "electricity", "music", "the Roman Empire", "gravity",
          "sleep", "mountains", "libraries", "robots", "bread", "snow", "friendship", "trains", "the sun",
          "mathematics"]


def templated_prompts(n: int) -> list[str]:
    return [t.format(topic) for topic in TOPICS for t in TEMPLATES][:n]


def cpu_name() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from tinyvllm.model.loader import _find_alias_gguf, transformers_reads_gguf_with_cached_reader

    gguf = _find_alias_gguf("SmolLM2-135M-Instruct")
    with transformers_reads_gguf_with_cached_reader():
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decode with transformers' KV cache, EOS ignored."""
    out_ids = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].float().argmax())
            out_ids.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def hf_token_logprobs(model, prompt_ids: list[int], cont: list[int]) -> list[float]:
    """Teacher-forced log-probability of each token of ``cont`` after ``prompt_ids``."""
    ids = prompt_ids + cont
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    idx = torch.arange(len(prompt_ids) - 1, len(ids) - 1)
    return lp[idx, torch.tensor(cont)].tolist()


def score(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(outputs equal to the reference, mean common-prefix length in tokens)."""
    prefixes = []
    for a, b in zip(ref, got):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return sum(a == b for a, b in zip(ref, got)), sum(prefixes) / len(prefixes)


def make_refs(out: Path, prompts: list[str]) -> None:
    import transformers
    from transformers import AutoTokenizer

    from tinyvllm.model.loader import _find_alias_gguf

    gguf = _find_alias_gguf("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompt_ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                  for p in prompts]
    data = {"prompts": prompts, "prompt_token_ids": prompt_ids, "num_tokens": NUM_TOKENS, "eos_token_id": tok.eos_token_id,
            "made_by": "benchmarks/bf16_fidelity.py refs",
            "machine": cpu_name(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = hf_model(dtype)
        data[name] = [hf_greedy(model, ids, NUM_TOKENS) for ids in prompt_ids]
        if name == "float32":
            data["float32_logprobs"] = [hf_token_logprobs(model, ids, c) for ids, c in zip(prompt_ids, data[name])]
        else:
            lps = [hf_token_logprobs(model, ids, c) for ids, c in zip(prompt_ids, data["float32"])]
            data["bfloat16_logprob_error"] = mean_abs(data["float32_logprobs"], lps)
        print(name, *score(data["float32"], data[name]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data) + "\n")
    print("wrote", out)


def mean_abs(ref: list[list[float]], got: list[list[float]]) -> float:
    flat = [abs(a - b) for r, g in zip(ref, got) for a, b in zip(r, g)]
    return sum(flat) / len(flat)


def tinyvllm_outputs(llm, refs: dict) -> tuple[list[list[int]], list[list[float]]]:
    """tinyvllm's greedy outputs and its teacher-forced logprobs of float32's continuations."""
    from tinyvllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": ids} for ids in refs["prompt_token_ids"]],
                        SamplingParams(temperature=0, max_tokens=refs["num_tokens"], ignore_eos=True))
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    if not hasattr(outs[0], "prompt_logprobs"):  # older commits (bisecting): greedy only
        return greedy, None
    forced = llm.generate([{"prompt_token_ids": ids + c} for ids, c in zip(refs["prompt_token_ids"], refs["float32"])],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lps = []
    for ids, c, o in zip(refs["prompt_token_ids"], refs["float32"], forced):
        lps.append([o.prompt_logprobs[len(ids) + i][t].logprob for i, t in enumerate(c)])
    return greedy, lps


def set_path(k, path: str) -> None:
    """Kernel choices for an A/B in one process: 'r' the float32 row attention kernel (tinyvllm's
    arithmetic before the tiled kernel), 'a' the tiled attention on vdpbf16ps instead of AMX tiles, 'g'
    gemm_bf16 on vdpbf16ps instead of AMX ('ag': what an AVX512-BF16 CPU without AMX runs). Switches
    that an older build lacks are skipped."""
    for name, on in (("set_tiled_attention", "r" not in path), ("set_amx_attention", "a" not in path),
                     ("set_amx_gemm", "g" not in path)):
        if hasattr(k, name):
            getattr(k, name)(on)


def compare(args) -> None:
    from tinyvllm import LLM
    from tinyvllm.kernels.cpu import cpu_kernels

    refs = json.loads(Path(args.refs).read_text())
    k = cpu_kernels()
    print(f"machine: {cpu_name()}; refs made on {refs['machine']} (transformers {refs['transformers']})")
    print(f"{'variant':34s} {'equal to fp32':>14s} {'mean prefix':>12s} {'|dlogp| nats':>13s}")
    hb = score(refs["float32"], refs["bfloat16"])
    print(f"{'transformers bf16':34s} {hb[0]:>9d}/{len(refs['float32']):<4d} {hb[1]:12.2f} "
          f"{refs['bfloat16_logprob_error']:13.4f}")
    # (older tinyvllm commits, for bisecting, have no quantization argument)
    kw = {} if args.quantization == "none" else {"quantization": args.quantization}
    llm = LLM("SmolLM2-135M-Instruct", dtype="bfloat16", **kw)
    for path in args.paths.split(","):
        set_path(k, path)
        greedy, lps = tinyvllm_outputs(llm, refs)
        eq, pre = score(refs["float32"], greedy)
        err = mean_abs(refs["float32_logprobs"], lps) if lps is not None else float("nan")
        print(f"{'tinyvllm ' + args.quantization + ' ' + path:34s} {eq:>9d}/{len(greedy):<4d} {pre:12.2f} "
              f"{err:13.4f}", flush=True)
    set_path(k, "default")


def attention(args) -> None:
    """Kernel-level error: SmolLM2's real bf16 queries and KV cache (captured from the attention calls
    of a chat prefill of ~1.1K tokens), each kernel's float32 output against float64 attention on the
    same bf16 inputs (relative RMS error), and what rounding the exact output to bf16 costs."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.kernels.cpu import cpu_kernels

    k = cpu_kernels()
    llm = LLM("SmolLM2-135M-Instruct", dtype="bfloat16")
    model = llm.llm_engine.core.model
    be = model.attn_backend
    orig, caps, calls = be.attention, [], [0]
    layers = model.config.num_hidden_layers
    wanted = {0, layers // 6, layers // 2, 5 * layers // 6, layers - 1}

    def capture(qkv, kv, md, rope, hq, hk, d, scale):
        out = orig(qkv, kv, md, rope, hq, hk, d, scale)
        layer = calls[0] % layers
        calls[0] += 1
        if layer in wanted and qkv.shape[0] > 100:
            caps.append(dict(layer=layer, qkv=qkv.clone(), kv=kv.clone(), bt=md.block_tables.clone(),
                             seq=md.token_seq.clone(), pos=rope.positions.clone(), cos=rope.cos, sin=rope.sin,
                             hq=hq, hk=hk, d=d, scale=scale))
        return out

    be.attention = capture
    text = (ROOT / "README.md").read_text()[:4000]
    llm.chat([{"role": "user", "content": "Summarize this document:\n" + text}],
             SamplingParams(temperature=0, max_tokens=1))
    be.attention = orig
    paths = {"row kernel (float32 P)": "r", "tiled, AMX": "", "tiled, vdpbf16ps": "a"}
    if not k.has_amx_attention():
        paths.pop("tiled, AMX")
    print(f"machine: {cpu_name()}; relative RMS error against float64, per captured prefill chunk")
    print(f"{'layer':>5s} {'mean max p':>10s} " + " ".join(f"{n:>23s}" for n in paths) + f" {'bf16(exact output)':>19s}")
    for c in caps:
        T, half = c["qkv"].shape[0], c["d"] // 2
        q = c["qkv"][:, : c["hq"] * c["d"]].float().view(T, c["hq"], c["d"])
        cos, sin = c["cos"][c["pos"]][:, None, :], c["sin"][c["pos"]][:, None, :]
        x1, x2 = q[..., :half], q[..., half:]
        q = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(torch.bfloat16).float()  # the kernel's q
        length = int(c["pos"].max()) + 1
        blocks = c["bt"][0].tolist()
        kv = [torch.cat([c["kv"][i][b] for b in blocks])[:length].double().repeat_interleave(c["hq"] // c["hk"], 1)
              for i in (0, 1)]
        s = torch.einsum("thd,lhd->htl", q.double(), kv[0]) * c["scale"]
        s = s.masked_fill(~(torch.arange(length)[None, :] <= c["pos"][:, None])[None], float("-inf"))
        p = torch.softmax(s, -1)
        ref = torch.einsum("htl,lhd->thd", p, kv[1])
        errs = []
        for path in paths.values():
            set_path(k, path)
            got = k.paged_attention(q, c["kv"][0], c["kv"][1], c["bt"], c["seq"], c["pos"], c["scale"])
            errs.append(float((got.double() - ref).norm() / ref.norm()))
        set_path(k, "default")
        rounding = float((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm())
        print(f"{c['layer']:5d} {float(p.max(-1).values.mean()):10.3f} " + " ".join(f"{e:23.2e}" for e in errs)
              + f" {rounding:19.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("refs")
    r.add_argument("--out", default=str(DEFAULT_REFS))
    r.add_argument("--templated", type=int, default=0,
                   help="instead of the 24 chat prompts, the first N of TEMPLATES x TOPICS (up to 200)")
    c = sub.add_parser("compare")
    c.add_argument("--refs", default=str(DEFAULT_REFS))
    c.add_argument("--quantization", default="none")
    c.add_argument("--paths", default="default", help="comma-separated kernel choices (set_path): default, r, a, ag")
    sub.add_parser("attention", help=attention.__doc__)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cmd == "refs":
        make_refs(Path(args.out), templated_prompts(args.templated) if args.templated else PROMPTS)
    elif args.cmd == "compare":
        compare(args)
    else:
        attention(args)


if __name__ == "__main__":
    main()
