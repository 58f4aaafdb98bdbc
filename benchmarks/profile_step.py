#!/usr/bin/env python3
"""Where one forward step's time goes, per kernel, on the CPU (the profile in docs/benchmarks.md).

    NT=2 B=1 Q=1 CTX=256 .venv/bin/python benchmarks/profile_step.py     # decode, batch 1
    NT=2 B=64 Q=1 CTX=384 .venv/bin/python benchmarks/profile_step.py    # decode, batch 64
    NT=2 B=1 Q=256 CTX=0 .venv/bin/python benchmarks/profile_step.py     # prefill, 256 tokens

Env: NT threads, B sequences, Q new tokens each, CTX cached context before them, N timed steps,
QUANT the --quantization (none, the default here; gguf: the native GGUF linears).
Every call into the C++ kernels (and F.linear, for float32 or older code) is wrapped with a timer;
"other" is the rest of the step (Python, embedding). K/V are random: timing only, not outputs.
"""
import time, torch, sys, os, collections
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's tinyvllm
import tinyvllm
from tinyvllm.model.loader import resolve_model
from tinyvllm.model import llama
from tinyvllm.model.weights import load_model
from tinyvllm.kernels import cpu as kernels_cpu
from tinyvllm.attention.selector import get_attn_backend
torch.set_num_threads(int(os.environ.get("NT","1")))
m = load_model(resolve_model("SmolLM2-135M-Instruct").model_dir, torch.bfloat16,  # noqa: E402
               quantization=os.environ.get("QUANT", "none"))  # QUANT=gguf: the native GGUF linears
cfg = m.config
B = int(os.environ.get("B","1")); Q=int(os.environ.get("Q","1")); ctx = int(os.environ.get("CTX","256")); bs=16
nb = (ctx+Q+bs)//bs + 1
kv = [torch.randn(2, B*nb, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
tables = [list(range(i*nb,(i+1)*nb)) for i in range(B)]
K = kernels_cpu.cpu_kernels()
acc = collections.defaultdict(float)
class Wrap:
    def __init__(s, k): s.k = k
    def __getattr__(s, name):
        f = getattr(s.k, name)
        def w(*a, **kw):
            t = time.perf_counter(); r = f(*a, **kw); acc[name] += time.perf_counter() - t; return r
        return w
W = Wrap(K)
kernels_cpu._KERNEL = W  # the loader's cached module: the backend chosen below (and the packed GEMM) use W
be = get_attn_backend("cpu", torch.bfloat16)
m.bind_attn_backend(be)
orig_lin = torch.nn.functional.linear
def lin(*a, **kw):
    t = time.perf_counter(); r = orig_lin(*a, **kw); acc[f"linear N={a[1].shape[0]} K={a[1].shape[1]}"] += time.perf_counter() - t; return r
llama.F.linear = lin
def step():
    md = be.build_metadata([Q]*B, [ctx+Q]*B, tables, bs)
    ids = torch.randint(0, 1000, (B*Q,)); pos = torch.arange(ctx, ctx+Q).repeat(B)
    with torch.inference_mode():
        h = m(ids, pos, kv, md)
        idx = torch.arange(Q-1, B*Q, Q)
        return m.compute_logits(h[idx])
for _ in range(2): step()
acc.clear()
N=int(os.environ.get("N","5"))
t=time.perf_counter()
for _ in range(N): step()
dt=(time.perf_counter()-t)/N
print(f"{be.name} backend: B={B} Q={Q} ctx={ctx} NT={torch.get_num_threads()} step {1000*dt:.2f} ms; tokens/s {B*Q/dt:.0f}")
tot=0
for k,v in sorted(acc.items(), key=lambda x:-x[1]):
    print(f"  {k:40s} {1000*v/N:8.2f} ms"); tot+=v
print(f"  {'other (python, embed, ...)':40s} {1000*(dt-tot/N):8.2f} ms")
