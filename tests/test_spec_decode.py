"""Speculative decoding (issue 44): proposers, the rejection sampler, and the engine with drafts.

* configuration: a bad ``speculative_config`` is a one-line error (LLM and the CLI);
* proposers against brute-force references (n-gram lookup; suffix-tree counts and speculation);
* the rejection sampler: greedy rows emit exactly the argmax walk; under sampling (temperature 0.8,
  top-p 0.9) the emitted tokens follow the target distribution (chi-square, fixed seed);
* the real SmolLM2 model: greedy output with speculation on equals off (the reference is the
  engine with speculation off, itself checked against transformers in test_real_model.py) for both
  methods, under batching, chunked prefill, preemption and prefix-cache hits; stop strings,
  logprobs, min_tokens, structured outputs and streaming deltas with several tokens;
* a tiny random model: the next-token distributions at temperature 0.8 + top-p with speculation
  on match off (two-sample chi-square); the large-sample version (power stated) is ``slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import EngineArgs, SpeculativeConfig
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sample.sampler import Sampler, SamplingMetadata
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.spec_decode.drafter import Drafter
from tinyvllm.spec_decode.policy import EXPLORE_EVERY, EXPLORE_MAX_EVERY, ExploreBackoff, SpecPolicy
from tinyvllm.spec_decode.rejection_sampler import rejection_sample
from tinyvllm.spec_decode.suffix_proposer import SuffixProposer, SuffixTree, speculate_from_sequence

from conftest import CHAT_PROMPTS

DATA = Path(__file__).parent / "data" / "bf16_fidelity.json"


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("cfg,match", [
    ({"method": "eagle"}, "method must be one of ngram, suffix"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "suffix", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in 1..16"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <="),
    ({"method": "ngram", "lookahead": 3}, "unknown key 'lookahead'"),
    ({"num_speculative_tokens": 3}, "method is required"),
    ('{"method": ', "not valid JSON"),
])
def test_bad_speculative_config_is_refused(cfg, match):
    arg = cfg if isinstance(cfg, str) else json.dumps(cfg)
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=arg).create_engine_config()
    if not isinstance(cfg, str):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(cfg)


def test_speculative_config_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram"}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (5, 2, 5)
    assert EngineArgs().create_engine_config().speculative_config is None


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_bad_speculative_config_is_one_line(command):
    argv = [sys.executable, "-m", "tinyvllm.entrypoints.cli", command] + (["hi"] if command == "generate" else [])
    r = subprocess.run(argv + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--speculative-config" in lines[0] and "num_speculative_tokens" in lines[0], lines


# ----------------------------------------------------------------------------- proposers
def _ngram_reference(toks: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest suffix n in [lo, hi] that occurs earlier; the tokens after its most recent earlier occurrence."""
    n_tok = len(toks)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = toks[n_tok - n:]
        for start in range(n_tok - n - 1, -1, -1):
            if toks[start:start + n] == suffix:
                return toks[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_brute_force():
    rng = np.random.default_rng(0)
    p = NgramProposer(2, 4, 5)
    found = 0
    for _ in range(400):
        toks = rng.integers(0, 5, size=int(rng.integers(1, 40))).tolist()
        want = _ngram_reference(toks, 2, 4, 5)
        assert p.propose(toks) == want, toks
        found += bool(want)
    assert found > 100  # the reference proposes often enough for the comparison to mean something
    assert NgramProposer(1, 3, 2).propose([7, 1, 2, 9, 1, 2]) == [9, 1]


def _occurrences(seqs: list[list[int]], pattern: list[int]) -> int:
    return sum(1 for s in seqs for i in range(len(s) - len(pattern) + 1) if s[i:i + len(pattern)] == pattern)


def test_suffix_tree_counts_and_removal():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 4, size=30).tolist() for _ in range(5)]
    tree = SuffixTree(max_depth=6)
    for s in seqs:
        tree.insert(s)
    for _ in range(200):
        pat = rng.integers(0, 4, size=int(rng.integers(1, 7))).tolist()
        node = tree.root
        for t in pat:
            node = node.children.get(t) if node is not None else None
        assert (node.count if node is not None else 0) == _occurrences(seqs, pat), pat
    for s in seqs:
        tree.remove(s)
    assert tree.root.children == {}


def test_suffix_scan_equals_the_suffix_tree_query():
    """The request's own drafts (a scan of its tokens) are the drafts its suffix tree would give."""
    rng = np.random.default_rng(2)
    nonempty = 0
    for _ in range(300):
        toks = rng.integers(0, 4, size=int(rng.integers(2, 60))).tolist()
        depth = int(rng.integers(2, 10))
        tree = SuffixTree(depth)
        tree.insert(toks)
        want = tree.speculate(toks[-depth:], 8, 1.5, 0.1)
        got = speculate_from_sequence(np.array(toks, dtype=np.int64), depth, 8, 1.5, 0.1)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (toks, depth)
        nonempty += bool(want[0])
    assert nonempty > 100


def test_suffix_copy_of_a_long_text_gets_a_long_draft():
    """Copying a file back (the agent-editing case): the longest match reaches the tree's depth, which
    leaves room for one draft token; a shorter match (ArcticInference tries every length) drafts the
    next max_depth / 2 tokens of the copy. The reference is the text being copied."""
    rng = np.random.default_rng(5)
    text = rng.integers(100, 5000, size=80).tolist()  # distinct enough: each 2-gram occurs once
    toks = text + [7, 8] + text[:40]  # 40 tokens into the copy
    want = text[40:52]  # max_depth 24, factor 1: a 12-token match leaves 12 tokens of depth
    got, score = speculate_from_sequence(np.array(toks, dtype=np.int64), 24, 16, 1.0, 0.1)
    assert got == want and score == pytest.approx(12.0)
    tree = SuffixTree(24)
    tree.insert(text)
    assert tree.speculate(toks[-24:], 16, 1.0, 0.1)[0] == want
    assert SuffixProposer().propose("r", toks[:60], toks[60:], 16) == want


def test_suffix_proposer_uses_the_global_tree_of_earlier_outputs():
    sp = SuffixProposer(max_depth=16, max_cached_requests=2)
    edit = [40, 41, 42, 43, 44, 45, 46, 47]
    assert sp.propose("a", [1, 2, 3, 40, 41], [], 6) == []  # nothing earlier to copy from
    sp.finish("a", edit)
    # a new request whose text ends like an earlier output: the global tree continues it
    assert sp.propose("b", [9, 9, 40, 41, 42], [], 6)[:3] == [43, 44, 45]
    sp.finish("b", [1])
    sp.finish("c", [2])  # "a" is the oldest of three: dropped from the global tree
    assert sp.propose("d", [9, 9, 40, 41, 42], [], 6) == []


def test_policy_turns_speculation_off_when_it_cannot_pay():
    pol = SpecPolicy()
    for t in range(1, 40):  # steps cost 10 ms + 1 ms per token
        pol.observe_step(t, 0.010 + 0.001 * t)
    a, b = pol.step_time_model()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.001)
    # one stream: a likely draft pays (g * t > b * E), an unlikely one does not
    assert pol.choose(1, 1, [(4, 0.9, False)]) == [4]
    assert pol.choose(1, 1, [(4, 0.05, False)]) == [0]
    # 16 streams: 0.5-likely drafts would cost more than they yield; explore gives one token
    assert pol.choose(16, 16, [(4, 0.5, False)] * 16) == [0] * 16
    assert pol.choose(16, 16, [(4, 0.5, True)] + [(4, 0.5, False)] * 15)[0] == 1
    assert SpecPolicy(disable_by_batch_size=8).choose(8, 8, [(4, 0.99, False)]) == [0]



def _compute_bound_policy() -> SpecPolicy:
    pol = SpecPolicy()
    for t in range(16, 40):  # steps cost 10 ms + 1 ms per token: a batch of 16 is compute-bound
        pol.observe_step(t, 0.010 + 0.001 * t)
    return pol


def _explored_steps(num_steps: int, backoff: ExploreBackoff, accept_at: frozenset = frozenset()) -> list[int]:
    """One request among 16 decoding, its acceptance estimate 0 (the cost model refuses its drafts), its
    proposer drafting every step; each explored draft token is rejected unless explored at a step in
    ``accept_at``. Returns the steps at which it explored."""
    pol, out = _compute_bound_policy(), []
    for step in range(num_steps):
        n = pol.choose(16, 16, [(4, 0.0, backoff.due("r"))])[0]
        backoff.step("r", n, pol.last_explored[0])
        if n:
            assert pol.last_explored[0] and n == 1
            out.append(step)
            backoff.outcome("r", 1 if step in accept_at else 0)
    return out


def test_exploration_backs_off_exponentially_and_an_accepted_exploration_resets_it():
    # the fixed interval (the rule before the back-off): every base + 1 steps, ~N / 17 explorations
    fixed = _explored_steps(1024, ExploreBackoff(cap=EXPLORE_EVERY))
    assert len(fixed) == 1024 // (EXPLORE_EVERY + 1)
    # back-off: the waits are 16, 32, 64, 128, 256, 256, ... idle steps (reference: summed by hand below)
    steps = _explored_steps(4096, ExploreBackoff())
    want, at, gap = [], -1, EXPLORE_EVERY
    while at + gap + 1 < 4096:
        at += gap + 1
        want.append(at)
        gap = min(2 * gap, EXPLORE_MAX_EVERY)
    assert steps == want
    for n in (64, 128, 256, 512, 1024):  # below the cap: log2(N / 16) explorations, not N / 17
        got = sum(s < n for s in steps)
        assert got <= np.log2(n / EXPLORE_EVERY) + 1 and got < sum(s < n for s in fixed)
    assert sum(s < 1024 for s in steps) == 7 and sum(s < 1024 for s in fixed) == 60
    # an accepted exploration (the 4th, after waits 16, 32, 64, 128) resets the wait to 16
    steps = _explored_steps(1024, ExploreBackoff(), accept_at=frozenset({want[3]}))
    assert steps[:5] == want[:4] + [want[3] + EXPLORE_EVERY + 1]
    assert steps[5] == steps[4] + 2 * EXPLORE_EVERY + 1  # and the back-off starts over
    # per proposer: while every exploration is rejected, a new request starts at the backed-off wait
    b = ExploreBackoff()
    _explored_steps(200, b)
    assert b.shared_gap == 128 and not b.due("new")
    b.outcome("r", 2)  # any accepted draft token restores the base wait
    assert b.shared_gap == EXPLORE_EVERY


def test_request_turning_repetitive_gets_drafts_again_within_a_bound():
    """The real drafter (ngram proposer, cost model, back-off) on one request of a batch of 16 whose
    text is noise for 1,000 steps (the verifier rejects every draft) and then repeats an 8-token cycle
    (drafts from the request's own text are right): it drafts again, several tokens per step, within
    ``EXPLORE_MAX_EVERY`` plus a few base intervals of the switch."""
    rng = np.random.default_rng(0)
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    prompt = rng.integers(0, 6, size=32).tolist()
    req = Request(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=4000),
                  eos_token_ids=frozenset(), max_tokens=4000)
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = len(prompt) - 1
    others = [Request(request_id=f"o{i}", prompt_token_ids=[1], sampling_params=SamplingParams(max_tokens=1),
                      eos_token_ids=frozenset(), max_tokens=1) for i in range(15)]  # waiting: not decoding
    cycle = list(range(100, 108))
    switch, explored_noise, first_long = 1000, 0, None
    for step in range(switch + EXPLORE_MAX_EVERY + 4 * EXPLORE_EVERY):
        drafter.propose([req] + others, 16)
        drafts = list(req.spec_token_ids)
        if step < switch:  # noise: the next token is anything but the first draft token
            explored_noise += bool(drafts)
            truth = [int(rng.choice([t for t in range(6) if not drafts or t != drafts[0]]))]
        else:
            truth = [cycle[(req.num_output_tokens - out0 + j) % 8] for j in range(len(drafts) + 1)]
        acc = 0
        while acc < len(drafts) and drafts[acc] == truth[acc]:
            acc += 1
        for t in drafts[:acc] + [truth[acc]]:
            req.append_output_token(t)
        req.num_computed_tokens = req.num_tokens - 1
        if drafts:  # the acceptance estimate, as Scheduler._count_spec keeps it
            rate = acc / min(len(drafts), acc + 1)
            a = req.spec_acceptance
            req.spec_acceptance = rate if a is None else 0.7 * a + 0.3 * rate
        drafter.observe(16 + len(drafts), 0.010 + 0.001 * (16 + len(drafts)), {"r": drafts} if drafts else {},
                        {"r": drafts[:acc]} if drafts else {})
        if step == switch - 1:
            out0 = req.num_output_tokens
            assert explored_noise <= 10  # backed off: ~log2(1000 / 16) + 1000 / 256 explorations, not ~60
        if step >= switch and len(drafts) > 1 and acc == len(drafts):
            first_long = step - switch
            break
    assert first_long is not None and first_long <= EXPLORE_MAX_EVERY + 4 * EXPLORE_EVERY


# ----------------------------------------------------------------------------- rejection sampler
def _md(rows: int, sp: SamplingParams, gens=None) -> SamplingMetadata:
    return SamplingMetadata.build([sp] * rows, [[]] * rows, [[]] * rows, gens or [None] * rows)


def test_rejection_sampler_greedy_emits_the_argmax_walk():
    torch.manual_seed(0)
    drafts = [[], [3], [5, 1, 2], [7, 7], [0, 1, 2, 3]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 8)
    am = logits.argmax(1).tolist()
    for i, d in enumerate(drafts):  # make some drafts right
        if d:
            s = sum(len(x) + 1 for x in drafts[:i])
            d[0] = am[s]
    tokens, rows = rejection_sample(Sampler(), logits, _md(logits.shape[0], SamplingParams(temperature=0)), drafts)
    s = 0
    for d, toks, rws in zip(drafts, tokens, rows):
        want = []
        for j in range(len(d) + 1):
            want.append(am[s + j])
            if j == len(d) or d[j] != am[s + j]:
                break
        assert toks == want and rws == list(range(s, s + len(want)))
        s += len(d) + 1


def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson goodness of fit of ``counts`` to ``probs`` (cells with expected < 5 pooled)."""
    exp = probs * counts.sum()
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return _chi2_sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1)


def test_rejection_sampler_preserves_the_target_distribution():
    """Each emitted token ~ p: the first token follows p_0 whatever the draft, and after an accepted
    first draft the second follows p_1 (temperature 0.8, top-p 0.9 applied to p first)."""
    torch.manual_seed(0)
    n, v = 20000, 6
    base = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0], [0.5, 2.0, 1.8, 0.0, -0.5, 1.0]])
    drafts = [[1, 2]] * n  # x_1 = 1 (p_0(1) ~ 0.3), x_2 = 2
    logits = torch.cat([base, base[1:].clone()]).repeat(n, 1)  # rows p_0, p_1, p_2 per request
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    md = _md(3 * n, sp)
    _, _, probs = Sampler().target_distribution(logits[:3], _md(3, sp))
    p0, p1 = probs[0].double().numpy(), probs[1].double().numpy()
    tokens, _ = rejection_sample(Sampler(), logits, md, drafts)
    first = np.bincount([t[0] for t in tokens], minlength=v)
    second = np.bincount([t[1] for t in tokens if t[0] == 1], minlength=v)
    assert 0.2 < first[1] / n < 0.4 and second.sum() > 4000  # both branches exercised
    assert _gof_pvalue(first, p0) > 1e-3
    assert _gof_pvalue(second, p1) > 1e-3
    # the test can fail: a sampler that always accepts the draft is caught
    assert _gof_pvalue(np.bincount([1] * n, minlength=v), p0) < 1e-6


# ----------------------------------------------------------------------------- the real model: greedy exactness
ECHO = ("Repeat this code exactly, then stop:\n\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
        "    return a - b\n")
EDIT = ('Here is config.json: {"name": "tinyvllm", "version": "0.3.0", "port": 8000, "debug": false}. '
        "Rewrite it with the port set to 9000 and nothing else changed.")
PROMPTS = CHAT_PROMPTS + [ECHO, EDIT]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def prompt_ids(smol_llm):
    return [smol_llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(smol_llm, prompt_ids):
    """Speculation off, the prompts as one batch without preemption: each prompt's own greedy tokens, since
    a batch gives every prompt the tokens it gets alone (tests/test_engine.py's batch invariance tests)."""
    outs = smol_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _no_leak(llm):
    kv = llm.llm_engine.core.scheduler.kv
    kv.check_invariants()
    assert kv.num_owned_blocks() == 0


@pytest.mark.parametrize("method", ["ngram", pytest.param("suffix", marks=pytest.mark.slow)])
def test_greedy_with_speculation_equals_without(method, make_smol_llm, prompt_ids, reference):
    """Batched, chunked prefill (64-token budget), 20 KV blocks of 16 (preemption), then again with the
    prompts' blocks in the prefix cache: token for token the non-speculative output."""
    llm = make_smol_llm(speculative_config={"method": method, "num_speculative_tokens": 4, "cost_model": False},
                        max_num_batched_tokens=64, num_kv_blocks=20)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        _no_leak(llm)
    st = llm.llm_engine.core.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    assert st["spec_decode_num_accepted_tokens"] > 20
    assert st["spec_decode_num_draft_tokens"] > st["spec_decode_num_accepted_tokens"]  # some were rejected
    assert sum(st["spec_decode_num_accepted_tokens_per_pos"]) == st["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def spec_llm(make_smol_llm):
    """SmolLM2 (bf16, shared weights) with ngram speculation at full length (no cost model)."""
    return make_smol_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "cost_model": False})


def test_stop_strings_logprobs_min_tokens_and_streaming(smol_llm, spec_llm, prompt_ids, reference):
    llm = spec_llm
    echo_ids = prompt_ids[PROMPTS.index(ECHO)]
    ref_text = smol_llm.get_tokenizer().decode(reference[PROMPTS.index(ECHO)])
    stop = ref_text[ref_text.index("def sub"):][:7]  # a stop string inside the copied (drafted) text
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[stop], logprobs=2),
              SamplingParams(temperature=0, max_tokens=7, min_tokens=5, logprobs=1)]
    for sp in params:
        want = smol_llm.generate({"prompt_token_ids": echo_ids}, sp)[0].outputs[0]
        got = llm.generate({"prompt_token_ids": echo_ids}, sp)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert len(got.logprobs) == len(got.token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) and a[t].rank == b[t].rank
    assert llm.llm_engine.core.stats()["spec_decode_num_accepted_tokens"] > 0
    # streaming: a step that accepts drafts delivers several tokens in one delta, and nothing is lost
    eng = llm.llm_engine
    eng.add_request({"prompt_token_ids": echo_ids}, GREEDY, request_id="s")
    deltas = []
    while eng.has_unfinished_requests():
        for o in eng.step(delta=True):
            deltas.append(o.outputs[0].token_ids)
    assert max(len(d) for d in deltas) > 1
    assert [t for d in deltas for t in d] == reference[PROMPTS.index(ECHO)]
    # streamed with a stop string inside a multi-token step: nothing past the stop is streamed
    sp = params[0]
    want = smol_llm.generate({"prompt_token_ids": echo_ids}, sp)[0].outputs[0]
    eng.add_request({"prompt_token_ids": echo_ids}, sp, request_id="s-stop")
    text, toks = "", []
    while eng.has_unfinished_requests():
        for o in eng.step(delta=True):
            text += o.outputs[0].text
            toks += o.outputs[0].token_ids
    assert (text, toks) == (want.text, want.token_ids) and stop not in text
    _no_leak(llm)


def test_n_greater_than_one_with_speculation(smol_llm, spec_llm, prompt_ids, reference):
    """n=2 greedy: both completions equal the plain output. n=3 seeded sampling (top-k 3): the same seed
    gives the same completions again, and every sampled token is among the 3 most likely under the
    plain engine's distribution of its context (prompt_logprobs of prompt + completion, one prefill)."""
    i = PROMPTS.index(ECHO)
    echo_ids = prompt_ids[i]
    before = spec_llm.llm_engine.core.stats()["spec_decode_num_accepted_tokens"]
    out = spec_llm.generate({"prompt_token_ids": echo_ids}, SamplingParams(n=2, temperature=0, max_tokens=20))[0]
    assert [c.token_ids for c in out.outputs] == [reference[i][:20]] * 2  # (greedy: a prefix of the 32 tokens)
    sp = SamplingParams(n=3, temperature=0.8, top_k=3, seed=7, max_tokens=16, ignore_eos=True)
    a = [c.token_ids for c in spec_llm.generate({"prompt_token_ids": echo_ids}, sp)[0].outputs]
    b = [c.token_ids for c in spec_llm.generate({"prompt_token_ids": echo_ids}, sp)[0].outputs]
    assert a == b and len(a) == 3 and all(len(t) == 16 for t in a)
    assert spec_llm.llm_engine.core.stats()["spec_decode_num_accepted_tokens"] > before
    full = [{"prompt_token_ids": echo_ids + t} for t in a]
    for t, o in zip(a, smol_llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=3))):
        ranks = [o.prompt_logprobs[len(echo_ids) + j][tok].rank for j, tok in enumerate(t)]
        assert max(ranks) <= 3, ranks
    _no_leak(spec_llm)


@pytest.mark.slow  # ~94 s under load 20 (a new engine with a tier, 6 generations): over the default tier's budget
def test_offload_tier_restores_a_session_with_speculation(smol_llm, make_smol_llm, prompt_ids):
    """A session's blocks are evicted from a small pool to the offload tier by another session, then
    its next turn loads them back and decodes with drafts: token for token the plain engine's output."""
    echo_ids, edit_ids = prompt_ids[PROMPTS.index(ECHO)], prompt_ids[PROMPTS.index(EDIT)]
    sp = SamplingParams(temperature=0, max_tokens=24)
    llm = make_smol_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "cost_model": False},
                        num_kv_blocks=10, kv_offload_size="32MiB")
    turn1 = smol_llm.generate({"prompt_token_ids": echo_ids}, sp)[0].outputs[0].token_ids
    turn2 = echo_ids + turn1 + echo_ids[-24:]  # the session's next turn repeats the request's tail
    prompts = [echo_ids, edit_ids, turn2]
    want = [o.outputs[0].token_ids for o in smol_llm.generate([{"prompt_token_ids": x} for x in prompts], sp)]
    got = [llm.generate({"prompt_token_ids": x}, sp)[0] for x in prompts]  # one at a time, in session order
    assert [o.outputs[0].token_ids for o in got] == want
    st = llm.stats()
    assert st["kv_offload_loaded_blocks"] > 0 and got[2].num_cached_tokens > 0
    assert st["spec_decode_num_accepted_tokens"] > 0
    _no_leak(llm)


def test_structured_output_drafts_follow_the_grammar(smol_llm, make_smol_llm):
    from tinyvllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "port": {"type": "integer"}},
              "required": ["name", "port"], "additionalProperties": False}
    ids = smol_llm.llm_engine.chat_prompt_ids([{"role": "user", "content": EDIT + " Answer in JSON."}])
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    want = smol_llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0]
    llm = make_smol_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 1, "cost_model": False})
    got = llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0]
    assert got.token_ids == want.token_ids
    json.loads(got.text)
    assert llm.llm_engine.core.stats()["spec_decode_num_drafts"] > 0
    _no_leak(llm)


# ----------------------------------------------------------------------------- sampling: the engine's distribution
@pytest.fixture(scope="module")
def peaked_tiny_model(tmp_path_factory):
    """A tiny random Llama (vocab 64) whose lm_head is scaled so next-token distributions are peaked
    (top token ~0.5-0.8): drafts are often accepted and often rejected."""
    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_llama

    from tinyvllm.model.dummy import save_word_level_tokenizer

    path = tmp_path_factory.mktemp("tiny_spec")
    make_tiny_llama(path, vocab=64, hidden=64, layers=2, num_heads=4, num_kv_heads=2)
    save_word_level_tokenizer(path, 64)
    w = load_file(str(path / "model.safetensors"))
    w["lm_head.weight"] *= 8.0
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True)
TINY_DTYPE = "bfloat16"  # the packed bf16 GEMM: one call per projection (fp32 goes through F.linear in slabs)
TINY_PROMPT = [3 + (i % 6) for i in range(30)]
TINY_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "cost_model": False}


def _positions(path: Path, spec: dict | None, n: int) -> tuple[list[np.ndarray], dict]:
    """Counts of the token at output positions 1..3 over ``n`` samples (position 0 comes from the
    prefill, never from a draft), and the engine's stats."""
    llm = LLM(str(path), dtype=TINY_DTYPE, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=4096,
              seed=1 if spec else 2, speculative_config=spec)
    toks: list[list[int]] = []
    for s in range(0, n, 1000):
        toks += [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": TINY_PROMPT}] * min(1000, n - s), SAMPLED)]
    arr = np.array(toks)
    return [np.bincount(arr[:, j], minlength=64) for j in (1, 2, 3)], llm.llm_engine.core.stats()


def _two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson chi-square test of homogeneity of two count vectors (cells with < 10 in both pooled)."""
    keep = (a + b) >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    nz = (a + b) > 0
    a, b = a[nz], b[nz]
    tab = np.stack([a, b]).astype(np.float64)
    exp = tab.sum(1, keepdims=True) * tab.sum(0, keepdims=True) / tab.sum()
    return _chi2_sf(float(((tab - exp) ** 2 / exp).sum()), len(a) - 1)


def _check_same_distribution(path: Path, n: int) -> tuple[list[np.ndarray], dict]:
    off, _ = _positions(path, None, n)
    on, st = _positions(path, TINY_SPEC, n)
    # drafts were verified at most steps, and both acceptance and rejection happened often
    assert st["spec_decode_num_drafts"] > n / 2
    assert 0.2 < st["spec_decode_num_accepted_tokens"] / st["spec_decode_num_draft_tokens"] < 0.9
    for j in range(3):
        pv = _two_sample_pvalue(off[j], on[j])
        print(f"position {j + 1}: p-value {pv:.4f} ({n} samples per arm)")
        assert pv > 1e-3, (j, off[j], on[j])
    return off, st


def test_sampling_distribution_with_speculation_matches_without(peaked_tiny_model):
    """Default tier: 500 samples per arm (detects gross errors, e.g. an always-accepting sampler)."""
    _check_same_distribution(peaked_tiny_model, 500)


def _power(p: np.ndarray, n: int, shift: float = 0.02, reps: int = 400, alpha: float = 1e-3) -> float:
    """Simulated power of :func:`_two_sample_pvalue` at level ``alpha`` with ``n`` samples per arm,
    against ``shift`` of probability mass moved from the most likely token to the second."""
    rng = np.random.default_rng(0)
    q = p.copy()
    top = np.argsort(-p)
    q[top[0]] -= shift
    q[top[1]] += shift
    hits = sum(_two_sample_pvalue(rng.multinomial(n, p), rng.multinomial(n, q)) < alpha for _ in range(reps))
    return hits / reps


@pytest.mark.slow
def test_sampling_distribution_large_sample(peaked_tiny_model):
    """24,000 samples per arm: power >= 0.9 to detect a 2% shift of probability mass at each position
    (simulated for the measured distribution, alpha 1e-3); the test passes at p > 1e-3."""
    n = 24000
    off, _ = _check_same_distribution(peaked_tiny_model, n)
    for j in range(3):
        power = _power(off[j] / off[j].sum(), n)
        print(f"position {j + 1}: power {power:.3f} to detect a 2% shift")
        assert power >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_exact_on_the_twenty_test_prompts_and_agent_editing(method, make_smol_llm, smol_llm):
    from tinyvllm.benchmarks.agent_editing import agent_editing_prompts

    tok = smol_llm.get_tokenizer()
    prompts = json.loads(DATA.read_text())["prompts"][:20]
    ids = [smol_llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    ids += [tok.encode(p) for p in agent_editing_prompts(8, tok)]
    sp = SamplingParams(temperature=0, max_tokens=96)
    ref = [smol_llm.generate({"prompt_token_ids": x}, sp)[0].outputs[0].token_ids for x in ids]
    for kw in (dict(), dict(max_num_batched_tokens=48, num_kv_blocks=128, block_size=8)):
        llm = make_smol_llm(speculative_config={"method": method}, **kw)
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": x} for x in ids], sp)
            assert [o.outputs[0].token_ids for o in outs] == ref
            _no_leak(llm)
        assert llm.llm_engine.core.stats()["spec_decode_num_accepted_tokens"] > 0


def test_metrics_use_vllm_names_and_bench_serve_summary():
    from tinyvllm.benchmarks.serve import _SPEC_RE, spec_decode_summary
    from tinyvllm.metrics.prometheus import ServerMetrics
    from tinyvllm.metrics.stats import SchedulerStats

    m = ServerMetrics("m")
    for drafts, tokens, acc, per_pos in ((3, 10, 4, [3, 1]), (5, 16, 7, [4, 2, 1])):
        m.update_from_stats(SchedulerStats(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=tokens,
                                           spec_decode_num_accepted_tokens=acc,
                                           spec_decode_num_accepted_tokens_per_pos=per_pos))
    text = m.render().decode()
    assert 'tinyvllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'tinyvllm:spec_decode_num_draft_tokens_total{model_name="m"} 16.0' in text
    assert 'tinyvllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'tinyvllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    import re

    after = {mt.group(1): float(mt.group(2)) for mt in (re.match(_SPEC_RE, ln) for ln in text.splitlines()) if mt}
    s = spec_decode_summary({"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 1}, after)
    assert s["acceptance_rate"] == pytest.approx(6 / 12) and s["mean_accepted_length"] == pytest.approx(1 + 6 / 4)


def test_agent_editing_dataset_repeats_the_file_it_asks_to_rewrite():
    from tinyvllm.benchmarks.agent_editing import agent_editing_dataset

    specs = agent_editing_dataset(8, 64, seed=3)
    assert specs == agent_editing_dataset(8, 64, seed=3) and len(specs) == 8

    def file_read(prompt: str) -> dict:
        start = prompt.rindex("<tool_result>") + len("<tool_result>")
        return json.loads(prompt[start:prompt.index("</tool_result>", start)])

    for s in specs:
        f = file_read(s.prompt)
        assert f["content"].startswith(("def ", "async def ")) and f["path"].startswith("tinyvllm/")
        assert s.prompt.endswith('"content": "') and '"name": "read_file"' in s.prompt and s.max_tokens == 64
    assert file_read(specs[0].prompt) == file_read(specs[3].prompt)  # a session edits one file


# ----------------------------------------------------------------------------- scheduler: rollback and the prefix cache
def _fake_next(context: list[int]) -> int:
    """A deterministic fake model over a vocabulary of 16 (so right drafts are common)."""
    return (sum(context[-3:]) * 7 + len(context)) % 16


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_rolls_back_rejected_drafts_and_never_caches_them(seed):
    """A fake worker that keeps the KV as the tokens written to each slot. With random drafts (some
    right, some wrong), few blocks (preemption) and shared prefixes (prefix hits): every step reads
    only KV of the request's real tokens, cached blocks hold exactly the tokens of their hash chain,
    outputs equal plain greedy decoding, and no block leaks."""
    from tinyvllm.config import CacheConfig, SchedulerConfig
    from tinyvllm.core.scheduler import Scheduler
    from tinyvllm.request import Request

    rng = np.random.default_rng(seed)
    bs = 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4),
                      CacheConfig(block_size=bs, enable_prefix_caching=True), num_blocks=18, max_model_len=256)
    kv: dict[int, list[int | None]] = {}  # block id -> token per slot (what "KV" was computed from)
    shared = rng.integers(0, 16, size=9).tolist()
    prompts = [shared + rng.integers(0, 16, size=int(rng.integers(1, 7))).tolist() for _ in range(6)]
    reqs = [Request(request_id=str(i), prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=20),
                    eos_token_ids=frozenset(), max_tokens=20) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    hit_checked = verified = 0
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled, accepted = {}, {}
        for rid, n in out.num_scheduled_tokens.items():
            r = sched.requests[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            table = sched.kv.get_block_ids(rid)
            start = r.num_computed_tokens
            for pos in range(start):  # every computed position's KV is of the request's own token
                assert kv[table[pos // bs]][pos % bs] == r.all_token_ids[pos]
                hit_checked += 1
            written = r.all_token_ids[start:start + n - len(drafts)] + drafts
            for j, t in enumerate(written):
                kv.setdefault(table[(start + j) // bs], [None] * bs)[(start + j) % bs] = t
            if start + n - len(drafts) == r.num_tokens:  # samples: verify the drafts greedily
                ctx = list(r.all_token_ids)
                acc = []
                for d in drafts:
                    if _fake_next(ctx) != d:
                        break
                    acc.append(d)
                    ctx.append(d)
                accepted[rid] = acc
                sampled[rid] = _fake_next(ctx)
                verified += bool(drafts)
        for r in sched.update_from_output(out, sampled, accepted):
            pass
        for r in list(sched.running):  # the next drafts: the right continuation, corrupted at random
            ctx, d = list(r.all_token_ids), []
            for _ in range(int(rng.integers(0, 5))):
                t = _fake_next(ctx) if rng.random() < 0.7 else int(rng.integers(0, 16))
                d.append(t)
                ctx.append(t)
            r.spec_token_ids = d if r.num_computed_tokens + 1 == r.num_tokens else []
        for block in sched.kv.block_pool.cached_block_hash_to_block.values():  # cached = its chain's tokens
            assert None not in kv[block.block_id]
    assert not sched.has_unfinished_requests() and sched.kv.num_owned_blocks() == 0
    for r in reqs:
        ctx, want = list(r.prompt_token_ids), []
        for _ in range(20):
            want.append(_fake_next(ctx))
            ctx.append(want[-1])
        assert r.output_token_ids == want
    st = sched.stats
    assert verified > 10 and 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0 and hit_checked > 0
