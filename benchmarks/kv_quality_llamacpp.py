"""Issue 39's anchor: tinyvllm's int8 / fp8 KV cache measured the way llama.cpp measures its own q8_0 cache
(``llama-perplexity --kl-divergence``), on the same GGUF and the same tokens.

llama.cpp (tools/perplexity/perplexity.cpp) tokenizes the text once, cuts it into ``n_chunk`` back-to-back
chunks of ``c`` tokens, evaluates each from an empty cache (first token -> BOS if the GGUF adds one), and scores
positions ``c/2 .. c-2`` of each chunk. The base run (f16 KV, ``--kl-divergence-base FILE``) writes the tokens
and those positions' log-probs (uint16 over ``[max - 16, max]``); the test run (``-ctk q8_0 -ctv q8_0
--kl-divergence``) prints the mean KL(base || test) and "Same top p" (argmax agreement).

This script reads the tokens from the base file, evaluates the same chunks with tinyvllm's ``LLM`` on the same
GGUF (bf16 model) with a bf16 cache (the reference) and with each ``--kv`` dtype, and prints, over the same
positions: the exact mean KL(bf16 KV || kv) (float64, whole vocabulary), the same KL through llama.cpp's
estimator (its uint16 encoding and -16 cut-off), top-1 agreement, and KL(llama.cpp f16 KV || tinyvllm) read
from the base file's log-probs (two engines' arithmetic and weights path, not a KV effect).

    python benchmarks/kv_quality_llamacpp.py --write-text /tmp/kvq.txt     # docs/*.md but benchmarks.md
    G=$(python -c "from tinyvllm.model.loader import _find_alias_gguf as f; print(f('SmolLM2-135M-Instruct'))")
    llama-perplexity -m $G -f /tmp/kvq.txt -c 2048 --chunks 8 -t 2 --kl-divergence-base b2048.dat
    llama-perplexity -m $G -f /tmp/kvq.txt -c 2048 --chunks 8 -t 2 --kl-divergence-base b2048.dat \
        --kl-divergence -ctk q8_0 -ctv q8_0
    python benchmarks/kv_quality_llamacpp.py --base b2048.dat --kv int8 fp8 --text /tmp/kvq.txt
    python benchmarks/kv_quality_llamacpp.py --base b2048.dat --no-amx --kv int8 int8/pv16   # int8 vs bf16 P V
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

import numpy as np
import torch
from kv_quality import set_int8_variant  # benchmarks/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"


class BaseFile:
    """``--kl-divergence-base`` file: ``_logits_``, n_ctx u32, n_vocab i32, n_chunk i32, n_chunk * n_ctx tokens
    (i32), then per chunk ``n_ctx - 1 - n_ctx/2`` rows of ``2*((n_vocab+1)/2) + 4`` uint16: (scale f32,
    min_log_prob f32) then the quantized log-probs."""

    def __init__(self, path: str):
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        assert bytes(raw[:8]) == b"_logits_", f"{path}: not a llama-perplexity logits file"
        self.n_ctx = int(np.frombuffer(raw[8:12], np.uint32)[0])
        self.n_vocab, self.n_chunk = (int(x) for x in np.frombuffer(raw[12:20], np.int32))
        off = 20 + 4 * self.n_ctx * self.n_chunk
        self.tokens = np.frombuffer(raw[20:off], np.int32).astype(np.int64)
        self.first = self.n_ctx // 2
        self.n_scored = self.n_ctx - 1 - self.first
        nv = 2 * ((self.n_vocab + 1) // 2) + 4
        self.rows = np.frombuffer(raw[off:], np.uint16).reshape(self.n_chunk, self.n_scored, nv)

    def chunk(self, i: int) -> list[int]:
        return self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx].tolist()

    def base_logprobs(self, i: int) -> torch.Tensor:
        """Chunk ``i``'s log-probs, decoded as llama.cpp does (``scale * q + min_log_prob``), [n_scored, n_vocab]."""
        r = np.ascontiguousarray(self.rows[i])
        head = torch.from_numpy(np.ascontiguousarray(r[:, :4]).view(np.float32).copy())  # scale, min_log_prob
        return head[:, :1] * torch.from_numpy(r[:, 4:4 + self.n_vocab].astype(np.float32)) + head[:, 1:2]


def log_softmax32(logits: torch.Tensor) -> torch.Tensor:
    """llama.cpp's float32 log-softmax (sum of exps in double)."""
    lg = logits.float()
    mx = lg.max(-1, keepdim=True).values
    return lg - mx - torch.log(torch.exp((lg - mx).double()).sum(-1, keepdim=True)).float()


def llamacpp_encode(logits: torch.Tensor) -> torch.Tensor:
    """What the base file would hold for these logits (uint16 grid over [max - 16, max]), decoded back."""
    lg = logits.float()
    mx = lg.max(-1, keepdim=True).values
    mn = torch.maximum(lg.min(-1, keepdim=True).values, mx - 16)
    scale = (mx - mn) / 65535.0
    q = torch.where(lg > mn, torch.round((lg - mn) / scale), torch.zeros_like(lg))
    return scale * q + (mn + log_softmax32(lg) - lg)  # min_log_prob = mn - mx - lse


def llamacpp_kl(base_lp: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's per-position KL(base || test) (base log-probs <= -16 dropped) and same-top."""
    kl = torch.where(base_lp > -16, base_lp.exp() * (base_lp - log_softmax32(logits)), 0.0).double().sum(-1)
    return kl, logits.argmax(-1) == base_lp.argmax(-1)


def exact_kl(ref: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(softmax(ref) || softmax(test)), float64 over the whole vocabulary, and argmax equality."""
    r, t = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    return (r.exp() * (r - t)).sum(-1), ref.argmax(-1) == test.argmax(-1)


class Engine:
    """A tinyvllm ``LLM`` on the alias's GGUF with one ``kv_cache_dtype``; ``logits`` returns the float32 logits
    of a prompt's positions [lo, hi) (its model's ``compute_logits`` is wrapped, as in kv_quality.py)."""

    def __init__(self, kv: str, max_len: int):
        from tinyvllm import LLM

        self.arm = kv  # a kv dtype, or an int8 kernel variant (kv_quality.set_int8_variant), set per call
        self.llm = LLM(MODEL, dtype="bfloat16", kv_cache_dtype=set_int8_variant(kv), max_num_batched_tokens=512,
                       kv_cache_memory="256MiB", enable_prefix_caching=False, max_model_len=max_len + 1)
        model = self.llm.llm_engine.core.runner.model
        orig, self.keep, self.seen, self.rows = model.compute_logits, (0, 0), 0, []

        def wrapped(h):
            out = orig(h)
            a, b = max(self.keep[0] - self.seen, 0), min(self.keep[1] - self.seen, out.shape[0])
            if b > a:
                self.rows.append(out[a:b].float().clone())
            self.seen += out.shape[0]
            return out

        model.compute_logits = wrapped

    def logits(self, tokens: list[int], lo: int, hi: int) -> torch.Tensor:
        from tinyvllm import SamplingParams

        self.keep, self.seen, self.rows = (lo, hi), 0, []
        set_int8_variant(self.arm)
        self.llm.generate([{"prompt_token_ids": tokens}],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        assert self.seen == len(tokens), (self.seen, len(tokens))  # every prompt position had its logits
        return torch.cat(self.rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-text", metavar="PATH", help="write the text (docs/*.md but benchmarks.md) and exit")
    ap.add_argument("--base", nargs="+", help="llama-perplexity --kl-divergence-base files (one per -c)")
    ap.add_argument("--kv", nargs="+", default=["int8", "fp8"])
    ap.add_argument("--text", help="the text the base files were made from: compare tinyvllm's tokens to them")
    ap.add_argument("--chunks", type=int, default=0, help="score only the first N chunks of each base file")
    ap.add_argument("--no-amx", action="store_true", help="attention on the AVX-512 vector path (every engine)")
    args = ap.parse_args()
    if args.no_amx:
        from tinyvllm.kernels.cpu import cpu_kernels

        if (kernels := cpu_kernels()) is not None:
            kernels.set_amx_attention(False)

    if args.write_text:
        docs = sorted(f for f in glob.glob(str(ROOT / "docs" / "*.md")) if not f.endswith("benchmarks.md"))
        Path(args.write_text).write_text("\n\n".join(Path(f).read_text() for f in docs))
        return

    import gguf
    from tinyvllm.model.loader import _find_alias_gguf

    fields = gguf.GGUFReader(str(_find_alias_gguf(MODEL))).fields
    add_bos = "tokenizer.ggml.add_bos_token" in fields and bool(fields["tokenizer.ggml.add_bos_token"].contents())
    bos = int(fields["tokenizer.ggml.bos_token_id"].contents())
    bases = [BaseFile(p) for p in args.base]
    t0 = time.time()
    engines = {kv: Engine(kv, max(b.n_ctx for b in bases)) for kv in ["bfloat16", *args.kv]}
    print(f"add_bos={add_bos}; engines up in {time.time() - t0:.0f} s; torch threads {torch.get_num_threads()}")
    if args.text:
        ids = engines["bfloat16"].llm.get_tokenizer()(Path(args.text).read_text())["input_ids"]
        ids = ([bos] if add_bos else []) + list(ids)
        toks = bases[0].tokens.tolist()
        print(f"tokens: tinyvllm's tokenizer gives {len(ids)}; the base file's {len(toks)} equal its first "
              f"{len(toks)} at {sum(x == y for x, y in zip(ids, toks))} positions")

    for b in bases:
        n_chunk = min(b.n_chunk, args.chunks or b.n_chunk)
        st = {kv: {k: [] for k in ("kl", "same", "lkl", "ckl", "csame")} for kv in engines}
        for i in range(n_chunk):
            t1, toks, base_lp = time.time(), b.chunk(i), b.base_logprobs(i)
            if add_bos:
                toks[0] = bos
            ref = engines["bfloat16"].logits(toks, b.first, b.n_ctx - 1)
            ref_enc = llamacpp_encode(ref)
            for kv, eng in engines.items():
                lg = ref if kv == "bfloat16" else eng.logits(toks, b.first, b.n_ctx - 1)
                if kv != "bfloat16":
                    kl, same = exact_kl(ref, lg)
                    st[kv]["kl"].append(kl), st[kv]["same"].append(same)
                    st[kv]["lkl"].append(llamacpp_kl(ref_enc, lg)[0])
                ckl, csame = llamacpp_kl(base_lp, lg)
                st[kv]["ckl"].append(ckl), st[kv]["csame"].append(csame)
            print(f"c={b.n_ctx} chunk {i + 1}/{n_chunk} ({time.time() - t1:.0f} s): KL so far " + " ".join(
                f"{kv} {torch.cat(s['kl']).mean():.5f}" for kv, s in st.items() if s["kl"]), flush=True)
        print(f"\nc = {b.n_ctx}: {n_chunk} chunks x {b.n_scored} = {n_chunk * b.n_scored} positions "
              f"({b.first}..{b.n_ctx - 2} of each chunk)\n")
        print("| tinyvllm KV | KL(bf16 KV ‖ kv), exact | KL, llama.cpp's estimator | same top-1 "
              "| KL(llama.cpp f16 KV ‖ tinyvllm kv) | same top-1 as llama.cpp f16 |\n|---|---|---|---|---|---|")
        for kv, s in st.items():
            c = {k: torch.cat(v).double() for k, v in s.items() if v}
            if kv == "bfloat16":
                print(f"| bf16 (reference) | 0 | 0 | 100 % | {c['ckl'].mean():.5f} | {100 * c['csame'].mean():.2f} % |")
            else:
                unc = c["kl"].std() / c["kl"].numel() ** 0.5
                print(f"| {kv} | {c['kl'].mean():.5f} ± {unc:.5f} | {c['lkl'].mean():.5f} | "
                      f"{100 * c['same'].mean():.2f} % | {c['ckl'].mean():.5f} | {100 * c['csame'].mean():.2f} % |")
        print(flush=True)


if __name__ == "__main__":
    main()
