"""bf16 against float32 on the tiny random model families (tests/tiny_models.py), ours vs transformers' bf16.

Per family: greedy agreement with transformers' float32 (outputs equal, mean common prefix) of our bf16
(C++ backend, packed GEMMs) and of transformers' bf16; the teacher-forced mean |log-probability -
float32's| of float32's own greedy tokens for both; and how many steps have a float32 top-1/top-2
margin below twice transformers' bf16 error (near-ties that decide greedy agreement either way).

    PYTHONPATH=. python benchmarks/bf16_families.py [family ...]   # run from the repository root
"""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "tests")
from tiny_models import FAMILIES, make_tiny_family
from tinyvllm import LLM, SamplingParams
import transformers

N = 32
fams = sys.argv[1:] or ["qwen2", "qwen3", "smollm3", "mistral", "gemma3", "qwen3moe"]
root = Path("/tmp/tinyvllm_bf16_families")

def prompts(vocab, n=8):
    g = torch.Generator().manual_seed(7)
    rand = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()
    base = rand(12)
    out = [rand(9), base + rand(3), base + rand(6), rand(21)]
    return (out + [rand(10 + i) for i in range(n)])[:n]

def hf_model(path, name, dtype):
    spec = FAMILIES[name]
    return getattr(transformers, spec.get("model", spec["cls"]) + "ForCausalLM").from_pretrained(str(path), dtype=dtype).eval()

def greedy(hf, ps):
    outs = []
    with torch.no_grad():
        for p in ps:
            seq = hf.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(seq[0, len(p):].tolist())
    return outs

def tf_logprobs(hf, ps, conts):
    """[per prompt] float64 logprobs [N, V] at the continuation positions."""
    out = []
    with torch.no_grad():
        for p, c in zip(ps, conts):
            lg = hf(torch.tensor([p + c])).logits[0, len(p) - 1: len(p) - 1 + N].double()
            out.append(lg.log_softmax(-1))
    return out

def score(ref, got):
    pre = []
    for a, b in zip(ref, got):
        n = 0
        while n < len(a) and a[n] == b[n]:
            n += 1
        pre.append(n)
    return sum(a == b for a, b in zip(ref, got)), sum(pre) / len(pre)

res = {}
for name in fams:
    d = root / name
    if not (d / "config.json").exists():
        make_tiny_family(d, name)
    cfg = json.loads((d / "config.json").read_text())
    ps = prompts(cfg["vocab_size"])
    f32 = hf_model(d, name, torch.float32)
    b16 = hf_model(d, name, torch.bfloat16)
    g32 = greedy(f32, ps)
    g16 = greedy(b16, ps)
    lp32 = tf_logprobs(f32, ps, g32)
    lp16 = tf_logprobs(b16, ps, g32)
    llm = LLM(str(d), dtype="bfloat16")
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp)]
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(ps, g32)],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    e_hf, e_ours, margins = [], [], []
    for p, c, a, b, o in zip(ps, g32, lp32, lp16, outs):
        for i, t in enumerate(c):
            ref = float(a[i, t])
            e_hf.append(abs(float(b[i, t]) - ref))
            e_ours.append(abs(o.prompt_logprobs[len(p) + i][t].logprob - ref))
            top = a[i].topk(2).values
            margins.append(float(top[0] - top[1]))
    m = torch.tensor(margins)
    r = dict(ours=score(g32, ours), hf16=score(g32, g16),
             lp_err_ours=sum(e_ours) / len(e_ours), lp_err_hf16=sum(e_hf) / len(e_hf),
             margin_median=float(m.median()), frac_margin_lt_hf_err=float((m < 2 * sum(e_hf) / len(e_hf)).float().mean()),
             frac_margin_lt_0p01=float((m < 0.01).float().mean()))
    res[name] = r
    print(name, json.dumps(r), flush=True)
