"""Tensor parallelism (issue 38 part 1): ``--tensor-parallel-size`` on torch.distributed (gloo).

Expected values come from the unsplit model (TP=1, itself proven against transformers in
test_model_families.py) or from transformers' greedy directly, never from the split code:

- the split layers of every family (column / row / vocab parallel, MoE experts, native GGUF blocks) give the
  unsplit model's float32 logits within 1e-4, on two ranks simulated by two threads (an exact float32 sum
  in place of gloo's: fast, no processes);
- real ranks (spawned processes, gloo): greedy tokens equal transformers' under batching, chunked prefill,
  prefix-cache hits, preemption and the host offload tier; each rank holds half the KV heads;
- a bad size is one line before any rank starts; a killed rank ends the engine with one line (and the
  server answers 503 and exits: slow tier, with the 2-node loopback group).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tinyvllm.distributed.parallel_state import TPGroup, split_sizes
from tinyvllm.model.tensor_parallel import TensorParallelError, check_tensor_parallel, head_partition, shard_model
from tinyvllm.model.weights import load_model

from tiny_models import FAMILIES, make_tiny_family, make_tiny_llama, write_family_gguf

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- the split, in one process


class _Shared:
    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.slots: list[torch.Tensor | None] = [None] * n


class ThreadTP(TPGroup):
    """Two ranks as two threads: the collectives meet at a barrier (sums in rank order, as gloo's two-rank ring)."""

    def __init__(self, rank: int, n: int, shared: _Shared) -> None:
        super().__init__(rank, n)
        self.shared = shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        sh = self.shared
        sh.slots[self.rank] = x.clone()
        sh.barrier.wait()
        parts = list(sh.slots)
        sh.barrier.wait()
        return parts

    def all_reduce_float32(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x.copy_(total)
        self.comm_calls += 1
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim=-1)


def _bind(model):
    from tinyvllm.attention.selector import get_attn_backend

    model.bind_attn_backend(get_attn_backend("cpu", torch.float32))
    return model


def _steps(model, tokens: list[int], blocks: list[int], bs: int = 4) -> list[torch.Tensor]:
    """Chunked prefill (20 + 25 tokens) and 3 decode steps over shuffled paged blocks; each step's logits."""
    cfg = model.config
    kv = [torch.full((2, 32, bs, cfg.num_key_value_heads, cfg.head_dim), float("nan"))
          for _ in range(cfg.num_hidden_layers)]
    be, out = model.attn_backend, []
    with torch.no_grad():
        for start, end in [(0, 20), (20, 45), (45, 46), (46, 47), (47, 48)]:
            md = be.build_metadata([end - start], [end], [blocks[:(end + bs - 1) // bs]], bs)
            out.append(model.compute_logits(model(torch.tensor(tokens[start:end]), torch.arange(start, end), kv, md)))
    return out


def _split_matches_whole(path: Path, tp: int = 2, **load_kw) -> float:
    """Largest |logit difference| between ``tp`` thread ranks and the whole model (float32)."""
    whole = _bind(load_model(path, torch.float32, **load_kw))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, whole.config.vocab_size, (48,), generator=g).tolist()
    blocks = list(range(32))
    random.Random(0).shuffle(blocks)
    ref = _steps(whole, tokens, blocks)
    shared, results, errors = _Shared(tp), [None] * tp, []
    models = [load_model(path, torch.float32, **load_kw) for _ in range(tp)]
    for r, m in enumerate(models):
        shard_model(m, ThreadTP(r, tp, shared))
        _bind(m)
    kv_heads = [m.config.num_key_value_heads for m in models]

    def run(r: int) -> None:
        try:
            results[r] = _steps(models[r], tokens, blocks)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    worst = 0.0
    for r in range(tp):
        for a, b in zip(results[r], ref):
            assert a.shape == b.shape
            worst = max(worst, float((a - b).abs().max()))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)  # every rank holds the same gathered logits (the same sampled tokens)
    cfg = whole.config
    assert sum(kv_heads) == max(cfg.num_key_value_heads, tp)  # each rank keeps only its KV heads
    assert worst < 1e-4, worst
    return worst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            base = tmp_path_factory.mktemp(name.replace(":", "_"))
            if name == "llama":
                made[name] = make_tiny_llama(base, tie=False)
            elif name == "llama:tied":
                made[name] = make_tiny_llama(base, tie=True)
            elif name.endswith(":q8"):
                made[name] = write_family_gguf(get(name[:-3]), base / "m.gguf", linear_qtype="Q8_0")
            else:
                made[name] = make_tiny_family(base, name, vocab=512)
        return made[name]

    return get


@pytest.mark.parametrize("name", ["llama:tied", pytest.param("llama", marks=pytest.mark.slow),
                                  *[pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]])
def test_split_layers_give_the_whole_models_logits(dirs, name):
    """Column-parallel QKV / gate_up, row-parallel o_proj / down_proj (float32 all-reduce), vocab-parallel
    embedding and LM head (tied and not), MoE experts split along their width: the whole model's logits."""
    _split_matches_whole(dirs(name))


@pytest.mark.slow
def test_native_gguf_blocks_split_on_block_boundaries(dirs, monkeypatch):
    """Native Q8_0 linears split by whole 32-value blocks (and 16-row groups) give the unsplit native model's
    logits; a split that would cut a block is one line."""
    from tinyvllm.kernels.cpu import cpu_kernels
    from tinyvllm.model import gguf_quant

    if cpu_kernels() is None:
        pytest.skip("no C++ kernels: native GGUF linears cannot run here")
    monkeypatch.setenv("TINYVLLM_GGUF_ACTIVATIONS", "bf16")
    monkeypatch.setattr(gguf_quant, "_INT8_ACTS", {})
    from tinyvllm.model.loader import resolve_model

    path = resolve_model(str(dirs("qwen3:q8")), "auto").model_dir
    assert load_model(path, torch.float32, quantization="gguf").quantization == "gguf"
    _split_matches_whole(path, quantization="gguf")
    from tinyvllm.model.tensor_parallel import _quant_cols, _quant_rows

    m = load_model(path, torch.float32, quantization="gguf")
    w = m.layers[0].mlp.down_proj.quant  # Q8_0 [64, 128]: 32-value blocks along K, 16-row groups along N
    with pytest.raises(TensorParallelError, match="not on a 32-value quant block") as e:
        _quant_cols(w, 16, 48, "down_proj")
    assert "\n" not in str(e.value)
    with pytest.raises(TensorParallelError, match="16-row groups"):
        _quant_rows(w, [(8, 16)], "down_proj")


def test_head_partition_and_bad_sizes_are_one_line():
    assert head_partition(9, 3, 2) == [(0, 6, 0, 2), (6, 3, 2, 1)]  # SmolLM2: whole GQA groups, uneven
    assert head_partition(4, 2, 2) == [(0, 2, 0, 1), (2, 2, 1, 1)]
    assert head_partition(8, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]  # KV replicated
    assert split_sizes(9, 2) == [5, 4]
    for heads, kv, tp in [(4, 2, 3), (4, 4, 8), (6, 2, 4)]:
        with pytest.raises(TensorParallelError) as e:
            head_partition(heads, kv, tp)
        assert "\n" not in str(e.value) and str(tp) in str(e.value)
    with pytest.raises(TensorParallelError, match="intermediate"):
        check_tensor_parallel({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 2}, 4)
    from tinyvllm.config import EngineConfig, ParallelConfig

    for kw, msg in [(dict(tensor_parallel_size=0), "tensor_parallel_size must be"),
                    (dict(tensor_parallel_size=3, nnodes=2), "not a multiple of nnodes"),
                    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank must be")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig.from_kwargs(**kw)
    pc = ParallelConfig.from_torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                                           "MASTER_PORT": "29511"})
    assert (pc.tensor_parallel_size, pc.torchrun_rank, pc.master_port, pc.headless) == (2, 1, 29511, True)
    assert pc.pipe_ranks() == [1] and pc.pipe_ranks_node0 == 1
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        ParallelConfig.from_torchrun_env({"RANK": "0", "WORLD_SIZE": "2"}, tensor_parallel_size=4)


@pytest.mark.slow
def test_cli_refuses_a_size_that_does_not_divide_the_heads_in_one_line(dirs):
    """``serve -tp 3`` on a 4-head / 2-KV-head model: one line, exit code 2, no traceback, no process started."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--model", str(dirs("qwen3")),
                        "-tp", "3", "--port", "8848", "--dtype", "float32"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if "ERROR" in ln]
    assert len(err) == 1 and "does not divide the heads" in err[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "engine core process started" not in r.stderr, r.stderr[-2000:]


# ----------------------------------------------------------------------------- real ranks (processes, gloo)


@pytest.fixture(scope="module")
def tp_llm(dirs):
    """An offline LLM at TP=2 (two spawned rank processes) on the tiny Qwen3 (4 heads, 2 KV heads), float32."""
    from tinyvllm import LLM

    llm = LLM(str(dirs("qwen3")), dtype="float32", tensor_parallel_size=2, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=16, enable_prefix_caching=True, kv_offload_size="16MiB")
    yield llm
    llm.llm_engine.core.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)

    def rand(k: int) -> list[int]:
        return torch.randint(3, vocab, (k,), generator=g).tolist()

    base = rand(12)
    return [rand(9), base + rand(3), base + rand(6), rand(21)]


def test_tp2_ranks_equal_transformers_hold_half_the_kv_and_a_killed_rank_is_one_line(dirs, tp_llm):
    """Two real ranks (gloo): greedy 24 tokens of 4 prompts equal transformers' float32 greedy, batched with chunked
    prefill (16-token budget), preempted (24 blocks), then again from prefix-cache hits, then one alone; rank 0
    holds half the KV heads; SIGKILL of rank 1 ends the engine with one line (one engine for all: start-up is
    the cost)."""
    import transformers

    from tinyvllm import SamplingParams

    path = dirs("qwen3")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = _prompts(512)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    got = [list(o.outputs[0].token_ids) for o in tp_llm.generate(inputs, sp)]
    s = tp_llm.stats()
    assert s["num_preemptions"] > 0, s
    assert got == ref
    again = [list(o.outputs[0].token_ids) for o in tp_llm.generate(inputs, sp)]
    assert tp_llm.stats()["cached_prompt_tokens"] > s["cached_prompt_tokens"]
    assert again == ref
    assert list(tp_llm.generate(inputs[1], sp)[0].outputs[0].token_ids) == ref[1]
    # sampled (unseeded) requests: every rank draws the same tokens, or later steps would diverge
    out = tp_llm.generate(inputs, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)

    # each rank holds half the KV heads: rank 0's KV tensors, and the KV bytes per token the cache is sized by
    ex = tp_llm.llm_engine.core.model_executor
    cfg = json.loads((path / "config.json").read_text())
    assert ex._call("kv_cache_shape")[3] == cfg["num_key_value_heads"] // 2
    assert ex.model_info().kv_bytes_per_token * 2 == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4

    # SIGKILL of rank 1 (last: it ends this engine): the next health check raises one line naming it; no hang
    from tinyvllm.executor.multiproc import RankDiedError

    ex.check_health()
    os.kill(ex.procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankDiedError, match=r"rank 1 \(pid \d+\)") as e:
        for _ in range(3):
            ex.check_health()
            time.sleep(0.2)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 30
    with pytest.raises(RankDiedError):
        tp_llm.generate(inputs[0], sp)  # a step fails the same way
    ex.shutdown()
    assert not any(p.is_alive() for p in ex.procs.values())


# ----------------------------------------------------------------------------- the server (slow tier)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _complete(srv, prompt: str = "The capital of France is", n: int = 8) -> str:
    import httpx

    r = httpx.post(srv.base + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_server_at_tp2_serves_smollm2_and_a_killed_rank_gives_503_and_exit(tmp_path):
    """The embedded SmolLM2 at -tp 2 (9 heads: 6 + 3) answers as at TP=1 (float32, greedy); SIGKILL of a rank:
    new requests get 503 (or a refused connection) and the API process exits non-zero, within 60 s."""
    import httpx

    from server_utils import Server, statuses_until_exit

    texts = {}
    for tp in ("1", "2"):
        srv = Server(tmp_path / f"tp{tp}.log", ["--dtype", "float32", "-tp", tp, "--max-model-len", "512"])
        try:
            srv.wait_healthy()
            texts[tp] = _complete(srv)
            if tp == "1":
                continue
            ranks = _children(srv.core_pid)
            assert len(ranks) >= 2, ranks
            os.kill(ranks[-1], signal.SIGKILL)
            statuses = statuses_until_exit(srv, 60, 0.2)
            assert srv.proc.wait(60) != 0
            assert 503 in statuses or statuses[-1:] == ["refused"], statuses
            assert "tensor-parallel rank" in srv.log_tail(20000), srv.log_tail()
        finally:
            srv.stop()
    assert texts["1"] == texts["2"], texts


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    """``--nnodes 2``: node 1 (rank 1, headless) and node 0 (rank 0 + HTTP) on 127.0.0.1 give TP=1's greedy text;
    node 1 exits 0 when node 0 shuts down."""
    from server_utils import Server

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = "29541"
    common = ["--dtype", "float32", "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
              "--max-model-len", "512"]
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", *common,
                                  "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(tmp_path / "node0.log", [*common, "--node-rank", "0"])
    try:
        srv.wait_healthy()
        two = _complete(srv)
    finally:
        srv.stop()
        code = node1.wait(60)
    one = Server(tmp_path / "one.log", ["--dtype", "float32", "--max-model-len", "512"])
    try:
        one.wait_healthy()
        assert _complete(one) == two
    finally:
        one.stop()
    assert code == 0, (tmp_path / "node1.log").read_text()[-3000:]


def test_engine_refuses_a_size_that_does_not_divide_the_heads(dirs):
    """The check the server runs before any process starts (the CLI's one line: slow tier above)."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.engine.core import check_parallel

    cfg = EngineConfig.from_kwargs(model=str(dirs("qwen3")), tensor_parallel_size=3)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 3 does not divide the heads"):
        check_parallel(cfg, torch.device("cpu"), dirs("qwen3"))
    pd = EngineConfig.from_kwargs(model=str(dirs("qwen3")), tensor_parallel_size=2,
                                  kv_transfer_config='{"kv_connector": "ZmqConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="not supported with --tensor-parallel-size > 1 yet"):
        check_parallel(pd, torch.device("cpu"), dirs("qwen3"))
