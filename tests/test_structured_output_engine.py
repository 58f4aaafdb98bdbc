"""Grammar-constrained decoding inside the engine, on a tiny random-weight Llama whose vocabulary is
one character per token (so a grammar over characters is a grammar over tokens): the bitmask, EOS
gating, n > 1, preemption, chunked prefill, prefix caching, and a compile that does not stall the
step loop."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import msgspec
import numpy as np
import pytest
import torch

from tiny_models import make_tiny_llama
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.messages import EngineCoreRequest
from tinyvllm.model.dummy import save_word_level_tokenizer
from tinyvllm.request import RequestStatus
from tinyvllm.sample.sampler import apply_token_bitmask
from tinyvllm.sampling_params import StructuredOutputsParams as SO
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.structured_output import StructuredOutputManager, XgrammarBackend

VOCAB_SIZE = 128
EOS = 2
# Token i is the character chr(i) for printable ASCII; the others are placeholders no grammar uses.
VOCAB = [chr(i) if 32 <= i < 127 else f"<|{i}|>" for i in range(VOCAB_SIZE)]
ENGINE = dict(block_size=4, max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=256, max_model_len=128)
PROMPTS = [[3 + (7 * i + 5 * j) % (VOCAB_SIZE - 3) for j in range(n)] for i, n in enumerate([5, 13, 22, 9, 30, 3])]


def text(ids) -> str:
    return "".join(VOCAB[t] for t in ids if t != EOS)


def char_backend() -> XgrammarBackend:
    return XgrammarBackend.from_vocab(VOCAB, [EOS], VOCAB_SIZE)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_so")
    make_tiny_llama(path, vocab=VOCAB_SIZE, hidden=64, layers=2, num_heads=4, num_kv_heads=2)
    save_word_level_tokenizer(path, VOCAB_SIZE)
    return path


@pytest.fixture(scope="module")
def make_llm(tiny_dir):
    def make(**kw):
        llm = LLM(str(tiny_dir), dtype="float32", **{**ENGINE, **kw})
        llm.llm_engine.core.structured_output_manager = StructuredOutputManager(char_backend)
        return llm
    return make


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "b": {"type": "string", "enum": ["x", "yy"]}},
               "required": ["a", "b"], "additionalProperties": False}
CASES = [SO(regex="[0-9]{2,4}-[a-z]{3}"), SO(choice=["alpha", "beta", "gamma"]), SO(json=JSON_SCHEMA),
         SO(grammar='root ::= "(" [0-9] [0-9]? [0-9]? ")"'), SO(regex="[a-c]{1,4}!")]


def _valid(so: SO, out: str) -> bool:
    import json

    if so.regex is not None:
        return re.fullmatch(so.regex, out) is not None
    if so.choice is not None:
        return out in so.choice
    if so.json is not None:
        import jsonschema
        try:
            jsonschema.validate(json.loads(out), JSON_SCHEMA)
        except Exception:  # noqa: BLE001
            return False
        return True
    return re.fullmatch(r"\([0-9]{1,3}\)", out) is not None


# ----------------------------------------------------------------------------- units


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("vocab", [100, 49152 + 7])  # not a multiple of 32 or 16; a real vocabulary's width
def test_apply_token_bitmask_matches_xgrammar_and_leaves_other_rows_alone(path, vocab):
    import xgrammar as xgr

    from tinyvllm.kernels.cpu import cpu_kernels
    from tinyvllm.sample.sampler import apply_token_bitmask_torch

    if path == "kernel" and cpu_kernels() is None:
        pytest.skip("no C++ kernels on this machine (tests/test_kernel_build.py says whether that is expected)")
    apply = apply_token_bitmask if path == "kernel" else apply_token_bitmask_torch
    torch.manual_seed(0)
    words = (vocab + 31) // 32
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32)
    bitmask[1, 1:] = 0  # a grammar-like row: almost everything forbidden
    ours = apply(logits.clone(), bitmask, torch.tensor([3, 1]))
    ref = logits.clone()
    full = torch.full((5, words), -1, dtype=torch.int32)  # xgrammar's indices name rows of both tensors
    full[3], full[1] = bitmask[0], bitmask[1]
    xgr.apply_token_bitmask_inplace(ref, full, indices=[3, 1])
    assert torch.equal(ours, ref)
    assert torch.isinf(ours[1]).sum() == vocab - int(bin(int(bitmask[1, 0]) & 0xFFFFFFFF).count("1"))
    assert torch.equal(ours[[0, 2, 4]], logits[[0, 2, 4]])  # unconstrained rows: bit-for-bit
    # rows=None: bitmask row r applies to logits row r.
    first = apply(logits.clone(), bitmask)
    assert torch.equal(first[:2], ref[[3, 1]].where(torch.isinf(ref[[3, 1]]), logits[:2]))
    assert torch.equal(first[2:], logits[2:])
    # Logits wider than the bitmask: the tail is forbidden.
    wide = apply(torch.zeros(1, 40), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(wide[0, 32:]).all() and not torch.isinf(wide[0, :32]).any()


def _allowed(bitmask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return {int(i) for i in np.nonzero(bits)[0] if i < VOCAB_SIZE}


def test_eos_is_allowed_only_where_the_grammar_accepts():
    mgr = StructuredOutputManager(char_backend)
    g = mgr.grammar_for(SO(regex="ab"), [EOS])
    g.wait(30)
    bm = np.full((1, 4), -1, dtype=np.int32)
    g.fill_bitmask(bm, 0)
    assert _allowed(bm, 0) == {ord("a")}
    assert g.accept_token(ord("a")) and not g.accept_token(EOS)  # a rejected token leaves the state
    g.fill_bitmask(bm, 0)
    assert _allowed(bm, 0) == {ord("b")}
    assert g.accept_token(ord("b"))
    g.fill_bitmask(bm, 0)
    assert _allowed(bm, 0) == {EOS} and not g.is_terminated()
    assert g.accept_token(EOS) and g.is_terminated()


def test_grammar_state_is_rebuilt_from_the_output():
    mgr = StructuredOutputManager(char_backend)
    g = mgr.grammar_for(SO(regex="abc"), [EOS])
    g.wait(30)
    g.sync([ord("a"), ord("b")])  # behind the output: catches up
    assert g.num_accepted == 2
    bm = np.zeros((1, 4), dtype=np.int32)
    g.fill_bitmask(bm, 0)
    assert _allowed(bm, 0) == {ord("c")}
    g.sync([ord("a")])  # ahead of the output: rolled back
    g.fill_bitmask(bm, 0)
    assert g.num_accepted == 1 and _allowed(bm, 0) == {ord("b")}


def test_compiles_are_shared_by_key():
    mgr = StructuredOutputManager(char_backend)
    gs = [mgr.grammar_for(SO(json=JSON_SCHEMA), [EOS]) for _ in range(3)] + [mgr.grammar_for(SO(regex="a"), [EOS])]
    for g in gs:
        g.wait(30)
    assert mgr.num_compiles == 2


def test_bitmask_survives_the_msgpack_round_trip(make_llm):
    llm = make_llm()
    core = llm.llm_engine.core
    core.add_request(EngineCoreRequest("c", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=SO(regex="[0-9]+")), [EOS]))
    core.add_request(EngineCoreRequest("u", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), [EOS]))
    core.scheduler.requests["c"].grammar.wait(30)
    core._check_compiled_grammars()
    sched = core.scheduler.schedule()
    core.structured_output_manager.fill_bitmask(sched, core.scheduler.requests)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sched), type=SchedulerOutput)
    assert back.structured_output_request_ids == ["c"]
    bm = np.frombuffer(back.grammar_bitmask, dtype=np.int32).reshape(1, -1)
    assert _allowed(bm, 0) == {ord(d) for d in "0123456789"}
    core.abort_requests(["c", "u"])


def test_only_rows_that_sample_get_a_bitmask_row(make_llm):
    llm = make_llm(max_num_batched_tokens=16)  # the 30-token prompt takes two steps
    core = llm.llm_engine.core
    sp = SamplingParams(temperature=0, max_tokens=4, structured_outputs=SO(regex="[0-9]+"))
    core.add_request(EngineCoreRequest("long", PROMPTS[4], sp, [EOS]))
    core.scheduler.requests["long"].grammar.wait(30)
    core._check_compiled_grammars()
    sched = core.scheduler.schedule()
    core.structured_output_manager.fill_bitmask(sched, core.scheduler.requests)
    assert sched.num_scheduled_tokens == {"long": 16} and sched.structured_output_request_ids == []
    core.abort_requests(["long"])


def test_xgrammar_works_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from tinyvllm.structured_output import XgrammarBackend\n"
            "from tinyvllm.sampling_params import StructuredOutputsParams as SO\n"
            "import numpy as np\n"
            "b = XgrammarBackend.from_vocab([chr(i) for i in range(32, 127)], [0])\n"
            "m = b.matcher(b.compile(SO(json={'type': 'object'})), [0])\n"
            "bm = np.zeros((1, 3), dtype=np.int32); m.fill_next_token_bitmask(bm, 0)\n"
            "assert m.accept_token(ord('{') - 32)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ----------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def reference(make_llm):
    """Each case alone, greedy: the outputs every other arrangement must reproduce."""
    llm = make_llm()
    outs = []
    for p, so in zip(PROMPTS, CASES):
        o = _gen(llm, [p], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))[0].outputs[0]
        outs.append((list(o.token_ids), o.finish_reason))
    return outs


def test_outputs_follow_the_grammar_and_stop_at_its_end(reference):
    for so, (ids, reason) in zip(CASES, reference):
        assert reason == "stop" and ids[-1] == EOS, (so, text(ids))
        assert EOS not in ids[:-1]
        assert _valid(so, text(ids)), (so, text(ids))


@pytest.mark.parametrize("opts", [
    dict(),                                          # batched
    dict(max_num_batched_tokens=8),                  # chunked prefill
    dict(num_kv_blocks=24, enable_prefix_caching=False),  # preemption (recompute)
    dict(block_size=16),
], ids=["batched", "chunked-prefill", "preemption", "block16"])
def test_batching_chunking_preemption_do_not_change_constrained_outputs(make_llm, reference, opts):
    llm = make_llm(**opts)
    # Compile every grammar first, so all five requests are admitted at the first step whatever the
    # machine's speed: with a compile still running, the others can finish before the last joins,
    # and then the tight KV cache never preempts (found by a random-order CI run).
    manager = llm.llm_engine.core.structured_output_manager
    for so in CASES:
        manager.grammar_for(so, [EOS]).wait(60)
    outs = _gen(llm, PROMPTS[:len(CASES)],
                [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so in CASES])
    assert [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == reference
    if "num_kv_blocks" in opts:
        assert llm.stats()["num_preemptions"] > 0
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0


def test_prefix_cache_hit_gives_the_same_constrained_output(make_llm, reference):
    llm = make_llm(enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=CASES[2])
    first = _gen(llm, [PROMPTS[2]], sp)[0]
    again = _gen(llm, [PROMPTS[2]], sp)[0]
    assert again.num_cached_tokens > 0
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == reference[2][0]


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(make_llm):
    llm = make_llm()
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [list(o.outputs[0].token_ids) for o in _gen(llm, PROMPTS[:3], plain)]
    mixed = _gen(llm, PROMPTS[:3] + PROMPTS[3:5], [plain] * 3 + [
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=so) for so in CASES[:2]])
    assert [list(o.outputs[0].token_ids) for o in mixed[:3]] == alone


def test_n_samples_each_have_their_own_grammar_state(make_llm):
    llm = make_llm()
    so = SO(regex="[a-z]{3,6}")
    out = _gen(llm, [PROMPTS[0]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20,
                                                 structured_outputs=so))[0]
    texts = [text(c.token_ids) for c in out.outputs]
    assert len(texts) == 4 and all(re.fullmatch("[a-z]{3,6}", t) for t in texts)
    assert len(set(texts)) > 1  # independent samples, each advancing its own matcher


def test_unsatisfiable_within_max_tokens_finishes_with_length(make_llm):
    llm = make_llm()
    o = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6,
                                               structured_outputs=SO(regex="[0-9]{20}")))[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 6 and text(o.token_ids).isdigit()


def test_a_compiling_grammar_does_not_block_other_requests(make_llm):
    llm = make_llm()
    core = llm.llm_engine.core
    gate = threading.Event()

    def slow_backend() -> XgrammarBackend:
        gate.wait(60)  # the compile thread is stuck until the test lets it go
        return char_backend()

    core.structured_output_manager = StructuredOutputManager(slow_backend)
    core.add_request(EngineCoreRequest("slow", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=SO(regex="[0-9]{5}")), [EOS]))
    core.add_request(EngineCoreRequest("free", PROMPTS[1], SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True), [EOS]))
    got: dict[str, list[int]] = {"slow": [], "free": []}
    finished = set()
    for _ in range(6):
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                finished.add(out.request_id)
    assert len(got["free"]) == 5 and "free" in finished  # ran to the end meanwhile
    assert got["slow"] == [] and core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_FSM
    gate.set()
    for _ in range(200):
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                finished.add(out.request_id)
        if "slow" in finished:
            break
    assert "slow" in finished and re.fullmatch("[0-9]{5}", text(got["slow"]))


def test_the_scheduler_advances_the_grammar_with_each_sampled_token(make_llm):
    llm = make_llm()
    core = llm.llm_engine.core
    core.add_request(EngineCoreRequest("g", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=6, structured_outputs=SO(regex="[0-9]{6}")), [EOS]))
    req = core.scheduler.requests["g"]
    req.grammar.wait(30)
    for _ in range(4):
        core.step()
        # update_from_output accepted the token just sampled (not only the next bitmask's catch-up)
        assert req.grammar.num_accepted == req.num_output_tokens > 0
    core.abort_requests(["g"])


def test_the_grammar_cache_is_bounded():
    mgr = StructuredOutputManager(char_backend, max_cached_grammars=2)
    for pat in ("a", "b", "a", "c", "a"):
        mgr.grammar_for(SO(regex=pat), [EOS]).wait(30)
    assert mgr.num_compiles == 3  # "a" stayed (recently used), "b" was dropped
    mgr.grammar_for(SO(regex="b"), [EOS]).wait(30)
    assert mgr.num_compiles == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux semantics")
@pytest.mark.parametrize("nice", [0, 7])
def test_the_compile_thread_runs_at_a_lower_priority(nice, monkeypatch):
    import os

    seen: list[int] = []

    def backend():  # runs in the compile thread: read that thread's own nice value there
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return char_backend()

    monkeypatch.setenv("TINYVLLM_GRAMMAR_COMPILE_NICE", str(nice))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    mgr = StructuredOutputManager(backend)
    g = mgr.grammar_for(SO(regex="a"), [EOS])
    g.wait(300)  # a low-priority thread on a busy machine can take a while: it returns once compiled
    assert g.ready and g.error is None
    assert seen == [min(19, base + nice)]
    assert mgr.compile_thread_nice == (None if nice == 0 else min(19, base + nice))
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's thread is untouched
    mgr.shutdown()


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="SCHED_IDLE is a Linux scheduling class")
@pytest.mark.parametrize("policy", ["idle", "normal"])
def test_the_compile_thread_runs_in_sched_idle(policy, monkeypatch):
    import os

    seen: list[int] = []

    def backend():  # runs in the compile thread: read that thread's own scheduling class there
        seen.append(os.sched_getscheduler(threading.get_native_id()))
        return char_backend()

    monkeypatch.setenv("TINYVLLM_GRAMMAR_COMPILE_SCHED", policy)
    caller = os.sched_getscheduler(threading.get_native_id())
    mgr = StructuredOutputManager(backend)
    g = mgr.grammar_for(SO(regex="a"), [EOS])
    g.wait(300)
    assert g.ready and g.error is None
    assert seen == [os.SCHED_IDLE if policy == "idle" else caller]
    assert mgr.compile_thread_idle == (policy == "idle")
    assert os.sched_getscheduler(threading.get_native_id()) == caller  # the caller's thread is untouched
    mgr.shutdown()
