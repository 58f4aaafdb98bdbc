"""Tests of the scheduler (tinyvllm/core/scheduler.py), driven by a fake model runner.

No model runs here.  :class:`FakeRunner` plays the worker: it "writes" each
scheduled token into a fake KV store at the slot its block table gives, then,
for each request whose step samples, reads the request's whole context back
from the store *through its block table* and derives the next token from it
deterministically.  A block-table or prefix-cache mistake therefore shows up as
a wrong context (asserted) or a different output than :func:`reference_output`,
which generates the same tokens without any scheduler.
"""

from __future__ import annotations

import random
import weakref

import msgspec
import pytest
from hypothesis import event, given, settings, strategies as st

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.scheduler import Scheduler, SchedulerOutput
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams

EOS = 2
VOCAB = 64


# ---------------------------------------------------------------------------- helpers

def next_token(context) -> int:
    """The fake model: a deterministic function of the whole context (ints hash stably)."""
    return hash(tuple(context)) % VOCAB


def make_request(rid, prompt, max_tokens=16, ignore_eos=True, max_model_len=None) -> Request:
    """A request as EngineCore.add_request builds it (max_tokens clipped to max_model_len)."""
    mt = max_tokens if max_model_len is None else min(max_tokens, max_model_len - len(prompt))
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   eos_token_ids=frozenset({EOS}), max_tokens=mt)


def reference_output(prompt, max_tokens, ignore_eos, max_model_len) -> list[int]:
    """What the fake model generates for this prompt, with no scheduler involved."""
    tokens = list(prompt)
    out: list[int] = []
    mt = min(max_tokens, max_model_len - len(prompt))
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if (not ignore_eos and t == EOS) or len(out) >= mt or len(tokens) >= max_model_len:
            return out


def make_scheduler(budget=2048, max_num_seqs=256, block_size=16, num_blocks=1024, max_model_len=16384,
                   prefix_caching=True, policy="continuous") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     scheduling_policy=policy),
                     CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
                     num_blocks, max_model_len)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class View:
    """One request's share of a step, as the fake worker reconstructs it from the data-only schedule:
    ``block_ids`` is the worker's own copy of the block table, ``request`` the scheduler's object."""

    def __init__(self, request: Request, num_new_tokens: int, block_ids: list[int], samples: bool) -> None:
        self.request, self.num_new_tokens, self.block_ids, self.samples = request, num_new_tokens, block_ids, samples


class FakeRunner:
    """Stands in for the model runner: keeps its own per-request state from the data-only schedule
    (as the real runner does), writes scheduled tokens' "KV", reads contexts back."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.block_size
        self.kv = [None] * (sched.kv.num_blocks * self.bs)
        self.tokens: dict[str, list[int]] = {}    # the worker's token history per request
        self.tables: dict[str, list[int]] = {}    # the worker's block table per request
        self.computed: dict[str, int] = {}
        self._last: tuple[SchedulerOutput, list[View]] | None = None  # the last schedule applied, its views

    def apply(self, out: SchedulerOutput) -> list[View]:
        """Apply the schedule to the worker's state (once per schedule) and return its views."""
        if self._last is not None and self._last[0] is out:
            return self._last[1]
        sent = out
        # The schedule is data: the worker works from a copy that crossed a (msgpack) process boundary.
        out = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=SchedulerOutput)
        assert out == sent
        for rid in out.finished_req_ids:
            assert rid in self.tokens, f"finished {rid} was never sent to the worker"
            del self.tokens[rid], self.tables[rid], self.computed[rid]
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.tables[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        c = out.scheduled_cached_reqs
        for rid, resumed, blocks, computed in zip(c.req_ids, c.resumed_from_preemption, c.new_block_ids,
                                                  c.num_computed_tokens):
            assert rid in self.tokens, f"cached {rid} unknown to the worker"
            self.tables[rid] = list(blocks) if resumed else self.tables[rid] + list(blocks)
            self.computed[rid] = computed
        views = []
        for rid, n in out.num_scheduled_tokens.items():
            r = self.sched.requests[rid]
            # The worker's copy agrees with the scheduler's state: tokens, block table, progress.
            assert self.tokens[rid] == r.all_token_ids, f"{rid}: worker's tokens differ from the scheduler's"
            assert self.tables[rid] == self.sched.kv.get_block_ids(rid), f"{rid}: worker's block table differs"
            assert self.computed[rid] == r.num_computed_tokens
            views.append(View(r, n, self.tables[rid], self.computed[rid] + n == len(self.tokens[rid])))
        self._last = (sent, views)
        return views

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.bs
        views = self.apply(out)
        # Like each layer of the model: first write the whole batch's new KV...
        for v in views:
            rid = v.request.request_id
            tokens = self.tokens[rid]
            start, end = self.computed[rid], self.computed[rid] + v.num_new_tokens
            assert end <= len(tokens)
            assert len(v.block_ids) * bs >= end, "block table too short for the step"
            for pos in range(start, end):
                self.kv[v.block_ids[pos // bs] * bs + pos % bs] = tokens[pos]
        # ...then attend over the cache: the context must be exactly the request's tokens.
        sampled = {}
        for v in views:
            if not v.samples:
                continue
            rid = v.request.request_id
            n = self.computed[rid] + v.num_new_tokens
            ctx = []
            for i in range(blocks_needed(n, bs)):
                b = v.block_ids[i]
                ctx.extend(self.kv[b * bs:b * bs + min(bs, n - i * bs)])
            assert ctx == self.tokens[rid][:n], f"request {rid}: KV context differs from its tokens"
            sampled[rid] = next_token(ctx)
            self.tokens[rid].append(sampled[rid])  # the worker's own token history
        return sampled

    def step(self, out: SchedulerOutput):
        return self.sched.update_from_output(out, self.execute(out))


_runners: "weakref.WeakKeyDictionary[Scheduler, FakeRunner]" = weakref.WeakKeyDictionary()


def runner_of(sched: Scheduler) -> FakeRunner:
    """The scheduler's fake runner (one per scheduler: its KV store must persist across steps)."""
    if sched not in _runners:
        _runners[sched] = FakeRunner(sched)
    return _runners[sched]


def run_to_completion(sched: Scheduler, max_steps=10_000, on_step=None):
    """Loop schedule -> fake execute -> update; returns the list of outputs (one per step)."""
    runner = runner_of(sched)
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "requests did not finish"
        out = sched.schedule()
        if on_step is not None:
            on_step(out)
        runner.step(out)
        sched.kv.check_invariants()
        outs.append(out)
    return outs


def ids(out: SchedulerOutput) -> list[str]:
    return list(out.num_scheduled_tokens)


def scheduled(sched: Scheduler, out: SchedulerOutput) -> list[View]:
    """The step's requests as the worker sees them (its state updated from ``out``)."""
    return runner_of(sched).apply(out)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# ---------------------------------------------------------------------------- property test

@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([4, 8, 16]))
    budget = draw(st.integers(8, 512))
    max_num_seqs = draw(st.integers(1, 16))
    prefix_caching = draw(st.booleans())
    policy = draw(st.sampled_from(["continuous", "continuous", "static"]))
    max_model_len = draw(st.integers(64, 400))
    # A few shared prefixes so that the prefix cache gets hits.
    prefixes = [toks(draw(st.integers(0, 10**6)), draw(st.integers(1, 200))) for _ in range(2)]
    n_req = draw(st.integers(1, 10))
    reqs = []
    for i in range(n_req):
        n = draw(st.integers(1, 300))
        pre = draw(st.sampled_from([None, 0, 1]))
        prompt = (prefixes[pre] if pre is not None else []) + toks(draw(st.integers(0, 10**6)), n)
        prompt = prompt[:min(n, max_model_len - 1)]  # EngineCore rejects prompts >= max_model_len
        arrival = draw(st.one_of(st.just(0), st.integers(0, 30)))
        reqs.append(dict(rid=f"r{i}", prompt=prompt, max_tokens=draw(st.integers(1, 40)),
                         ignore_eos=draw(st.booleans()), arrival=arrival))
    # The pool must hold each request alone (prompt + all outputs but the last); beyond that,
    # from tight (constant preemption) to ample.
    need = [blocks_needed(len(r["prompt"]) + min(r["max_tokens"], max_model_len - len(r["prompt"])) - 1,
                          block_size) for r in reqs]
    extra = draw(st.one_of(st.integers(0, 2), st.integers(0, max(need)), st.integers(0, sum(need))))
    num_blocks = max(need) + extra
    aborts = draw(st.lists(st.tuples(st.integers(0, 200), st.integers(0, n_req - 1), st.booleans()),
                           max_size=3))
    return dict(block_size=block_size, budget=budget, max_num_seqs=max_num_seqs,
                prefix_caching=prefix_caching, policy=policy, max_model_len=max_model_len,
                reqs=reqs, num_blocks=num_blocks, aborts=aborts)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_scheduler_invariants_under_random_load(sc):
    bs, budget, max_seqs = sc["block_size"], sc["budget"], sc["max_num_seqs"]
    mml = sc["max_model_len"]
    sched = make_scheduler(budget=budget, max_num_seqs=max_seqs, block_size=bs, num_blocks=sc["num_blocks"],
                           max_model_len=mml, prefix_caching=sc["prefix_caching"], policy=sc["policy"])
    runner = runner_of(sched)
    by_id = {r["rid"]: r for r in sc["reqs"]}
    objs: dict[str, Request] = {}
    # step -> [(request id, abort between schedule and update?)]
    aborts: dict[int, list] = {}
    for step, idx, mid in sc["aborts"]:
        aborts.setdefault(step, []).append((f"r{idx}", mid))
    last_computed: dict[str, tuple[int, int]] = {}  # rid -> (num_preemptions, num_computed_tokens)
    aborted: set[str] = set()
    finished: set[str] = set()
    prev_running: list[str] = []
    last_arrival = max(r["arrival"] for r in sc["reqs"])
    # Each step the oldest running request (never preempted: it fits alone) advances >= 1 token.
    bound = last_arrival + sum(len(r["prompt"]) + r["max_tokens"] for r in sc["reqs"]) + 2
    total_preempted = 0
    static = sc["policy"] == "static"
    batch: set[str] = set()  # static policy: the current batch

    def check_monotone(r: Request):
        p, c = last_computed.get(r.request_id, (0, 0))
        if r.num_preemptions == p:
            assert r.num_computed_tokens >= c, f"{r.request_id}: num_computed_tokens went down"
        else:
            assert r.num_preemptions > p
        assert 0 <= r.num_computed_tokens <= r.num_tokens
        last_computed[r.request_id] = (r.num_preemptions, r.num_computed_tokens)

    step = 0
    while step <= last_arrival or sched.has_unfinished_requests():
        assert step <= bound, "requests did not finish in the bounded number of steps"
        for spec in sc["reqs"]:
            if spec["arrival"] == step:
                req = make_request(spec["rid"], spec["prompt"], spec["max_tokens"], spec["ignore_eos"], mml)
                objs[spec["rid"]] = req
                sched.add_request(req)
        mid_aborts = []
        for rid, mid in aborts.get(step, []):
            if rid not in objs:
                continue
            if mid:
                mid_aborts.append(rid)
                continue
            owned_before = sched.kv.num_owned_blocks()
            held = len(sched.kv.get_block_ids(rid))
            got = sched.abort_requests([rid])
            if got:
                aborted.add(rid)
                assert objs[rid].status == RequestStatus.FINISHED_ABORTED
                # Its blocks are freed at once (shared prefix blocks only lose a reference).
                assert sched.kv.get_block_ids(rid) == []
                assert owned_before - held <= sched.kv.num_owned_blocks() <= owned_before
            sched.kv.check_invariants()

        pre_running = [r.request_id for r in sched.running]
        pre_waiting = [r.request_id for r in sched.waiting]
        assert pre_running == [rid for rid in prev_running if rid not in aborted]  # only aborts between steps
        out = sched.schedule()
        sched_ids = ids(out)

        # Limits.
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.num_scheduled_tokens) <= max_seqs
        assert len(sched.running) <= max_seqs
        assert len(set(sched_ids)) == len(sched_ids)
        assert all(s.num_new_tokens >= 1 for s in scheduled(sched, out))
        assert out.num_prefill_tokens + out.num_decode_tokens == out.total_num_scheduled_tokens
        # Never schedule a finished or aborted request.
        assert not (set(sched_ids) & (aborted | finished))
        # Preemption victims are the most recently admitted running requests, newest first,
        # and are not scheduled in the same step; nothing is admitted in a step that preempts.
        total_preempted += len(out.preempted_req_ids)
        assert out.preempted_req_ids == pre_running[::-1][:len(out.preempted_req_ids)]
        assert not set(out.preempted_req_ids) & set(sched_ids)
        if out.preempted_req_ids:
            assert set(sched_ids) <= set(pre_running)
        for rid in out.preempted_req_ids:
            r = objs[rid]
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            assert sched.kv.get_block_ids(rid) == []
            assert sched.waiting and rid in [w.request_id for w in sched.waiting]
        # Running requests come first, in order; the rest are admitted in FCFS order.
        n_run = sum(1 for rid in sched_ids if rid in pre_running)
        assert sched_ids[:n_run] == [rid for rid in pre_running if rid in sched_ids]
        assert sched_ids[n_run:] == pre_waiting[:len(sched_ids) - n_run]
        # No running decode is starved when the budget covers one token per sequence.
        if budget >= max_seqs:
            assert set(pre_running) - set(out.preempted_req_ids) <= set(sched_ids)
        # Progress: an empty step with work to do only happens right after a preemption.
        if sched.has_unfinished_requests() and out.is_empty:
            assert out.preempted_req_ids
        if static:
            # A new batch (the first max_num_seqs waiting requests) is formed only once every
            # member of the previous one has finished; only the current batch ever runs.
            for rid in sched_ids:
                if rid not in batch:
                    assert batch <= finished | aborted, f"{rid} admitted while the batch is unfinished"
                    batch = set(pre_waiting[:max_seqs])
                    assert rid in batch
            assert {r.request_id for r in sched.running} <= batch
        for s in scheduled(sched, out):
            r = s.request
            check_monotone(r)
            if r.request_id not in pre_running:  # (re)admitted: starts at a prefix-cache hit
                assert r.num_computed_tokens % bs == 0 and r.num_computed_tokens < r.num_tokens
                if not sc["prefix_caching"]:
                    assert r.num_computed_tokens == 0
                if r.num_preemptions == 0:
                    assert r.num_computed_tokens == r.num_cached_tokens
            end = r.num_computed_tokens + s.num_new_tokens
            assert end <= r.num_tokens and end <= mml
            assert len(s.block_ids) == blocks_needed(end, bs)
            assert len(set(s.block_ids)) == len(s.block_ids)
            assert s.block_ids == sched.kv.get_block_ids(r.request_id)
        sched.kv.check_invariants()

        for rid in mid_aborts:  # aborted while the step "runs": its result is dropped
            if sched.abort_requests([rid]):
                aborted.add(rid)
        touched = runner.step(out)
        for r in touched:
            if r.status.is_finished:
                finished.add(r.request_id)
                assert sched.kv.get_block_ids(r.request_id) == []
        for r in sched.running:
            check_monotone(r)
            assert len(sched.kv.get_block_ids(r.request_id)) == blocks_needed(r.num_computed_tokens, bs)
        for r in sched.waiting:
            assert sched.kv.get_block_ids(r.request_id) == []
        sched.kv.check_invariants()
        prev_running = [r.request_id for r in sched.running]
        step += 1

    assert sched.kv.num_owned_blocks() == 0
    assert not sched.requests and not sched.kv.req_to_blocks
    runner.apply(sched.schedule())  # the last finishes reach the worker with the next schedule
    assert not runner.tokens and not runner.tables, "the worker kept state of finished requests"
    assert finished | aborted == set(by_id)
    assert sched.stats.num_preemptions == total_preempted
    for rid in finished - aborted:
        spec, r = by_id[rid], objs[rid]
        assert r.output_token_ids == reference_output(spec["prompt"], spec["max_tokens"], spec["ignore_eos"],
                                                      mml), f"{rid}: output differs from the reference"
    event(f"policy {sc['policy']}, preempted: {total_preempted > 0}")
    event(f"prefix hits: {sched.stats.prefix_cache_hits > 0}")


# ---------------------------------------------------------------------------- chunked prefill

def test_long_prompt_is_chunked_at_budget_boundaries():
    sched = make_scheduler(budget=2048, block_size=16, num_blocks=600, max_model_len=16384)
    req = make_request("long", toks(1, 8192), max_tokens=3)
    sched.add_request(req)
    runner = runner_of(sched)
    for start in (0, 2048, 4096, 6144):
        out = sched.schedule()
        assert len(out.num_scheduled_tokens) == 1
        s = scheduled(sched, out)[0]
        assert req.num_computed_tokens == start and s.num_new_tokens == 2048
        assert s.samples == (start == 6144)
        assert len(s.block_ids) == (start + 2048) // 16
        assert out.num_prefill_tokens == 2048 and out.num_decode_tokens == 0
        touched = runner.step(out)
        assert req.num_computed_tokens == start + 2048
        assert req.num_output_tokens == (1 if start == 6144 else 0)
        assert touched == ([req] if start == 6144 else [])
    # Then it decodes one token per step.
    for n in (8192, 8193):
        out = sched.schedule()
        assert req.num_computed_tokens == n and scheduled(sched, out)[0].num_new_tokens == 1
        assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 0
        runner.step(out)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 3
    assert sched.kv.num_owned_blocks() == 0


def test_decodes_are_not_starved_by_a_chunked_prefill():
    budget = 256
    sched = make_scheduler(budget=budget, block_size=16, num_blocks=400, max_model_len=4096)
    decoders = [make_request(f"d{i}", toks(10 + i, 20), max_tokens=100) for i in range(3)]
    for r in decoders:
        sched.add_request(r)
    runner = runner_of(sched)
    runner.step(sched.schedule())  # the three short prompts: prefilled in one step
    assert all(r.num_output_tokens == 1 for r in decoders)
    long = make_request("long", toks(99, 2000), max_tokens=5)
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = sched.schedule()
        by = {s.request.request_id: s for s in scheduled(sched, out)}
        # Every decoding request gets exactly one token, ahead of the prefill...
        assert ids(out)[:3] == ["d0", "d1", "d2"]
        assert all(by[r.request_id].num_new_tokens == 1 and by[r.request_id].samples for r in decoders)
        assert out.num_decode_tokens == 3
        # ... and the prefill takes the rest of the budget.
        chunks.append(by["long"].num_new_tokens)
        assert by["long"].num_new_tokens == min(budget - 3, 2000 - long.num_computed_tokens)
        assert out.total_num_scheduled_tokens <= budget
        runner.step(out)
    assert sum(chunks) == 2000 and len(chunks) == -(-2000 // (budget - 3))
    assert all(r.num_output_tokens == 1 + len(chunks) for r in decoders)


# ---------------------------------------------------------------------------- batching policies

def test_continuous_batching_admits_a_waiting_request_the_very_next_step():
    sched = make_scheduler(budget=512, max_num_seqs=3, block_size=8, num_blocks=200, max_model_len=1024)
    max_tokens = [3, 5, 8, 4, 6, 2, 7]
    reqs = [make_request(f"r{i}", toks(i, 10 + i), max_tokens=m) for i, m in enumerate(max_tokens)]
    for r in reqs:
        sched.add_request(r)
    runner = runner_of(sched)
    admitted_step, finished_step = {}, {}
    step = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for s in scheduled(sched, out):
            admitted_step.setdefault(s.request.request_id, step)
        # max_num_seqs stays saturated while there is waiting work.
        assert len(sched.running) == min(3, len(sched.running) + len(sched.waiting))
        for r in runner.step(out):
            if r.status.is_finished:
                finished_step[r.request_id] = step
        step += 1
    # FCFS admission; the k-th finish frees the slot taken by request k + 3 on the next step.
    assert sorted(admitted_step, key=admitted_step.get) == [r.request_id for r in reqs]
    finishes = sorted(finished_step.values())
    for i in range(3, len(reqs)):
        assert admitted_step[f"r{i}"] == finishes[i - 3] + 1
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens
    assert sched.kv.num_owned_blocks() == 0


def test_static_batching_waits_for_the_whole_batch():
    sched = make_scheduler(budget=2048, max_num_seqs=4, block_size=8, num_blocks=200, max_model_len=1024,
                           policy="static")
    max_tokens = [5, 1, 9, 3, 2, 7, 4, 6, 8, 3]
    reqs = [make_request(f"r{i}", toks(i, 12), max_tokens=m) for i, m in enumerate(max_tokens)]
    for r in reqs:
        sched.add_request(r)
    batches: list[set[str]] = []

    def on_step(out):
        new = {s.request.request_id for s in scheduled(sched, out) if s.request.num_computed_tokens == 0}
        if new:
            # Admission only into an empty engine: all of the previous batch has finished.
            assert {r.request_id for r in sched.running} == new
            batches.append(new)

    run_to_completion(sched, on_step=on_step)
    assert batches == [{"r0", "r1", "r2", "r3"}, {"r4", "r5", "r6", "r7"}, {"r8", "r9"}]
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens
    assert sched.kv.num_owned_blocks() == 0


def test_static_batch_admitted_over_several_steps_stays_the_same_batch():
    """A batch whose prompts need several steps of budget is still the first max_num_seqs requests,
    even if an early member finishes before the last one was admitted."""
    sched = make_scheduler(budget=16, max_num_seqs=3, block_size=8, num_blocks=200, max_model_len=1024,
                           policy="static")
    reqs = [make_request(f"r{i}", toks(i, 16), max_tokens=1 if i == 0 else 4) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    admitted: list[str] = []
    concurrent: list[set[str]] = []

    def on_step(out):
        admitted.extend(s.request.request_id for s in scheduled(sched, out) if s.request.num_computed_tokens == 0)
        concurrent.append({r.request_id for r in sched.running})

    run_to_completion(sched, on_step=on_step)
    first, second = {"r0", "r1", "r2"}, {"r3", "r4", "r5"}
    assert admitted == [f"r{i}" for i in range(6)]
    for running in concurrent:  # the two batches never overlap
        assert running <= first or running <= second


def test_static_batch_member_aborted_before_admission_does_not_let_a_stranger_in():
    sched = make_scheduler(budget=16, max_num_seqs=3, block_size=8, num_blocks=200, max_model_len=1024,
                           policy="static")
    reqs = [make_request(f"r{i}", toks(i, 16), max_tokens=6) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    runner = runner_of(sched)
    runner.step(sched.schedule())  # the budget admits one 16-token prompt per step: r0
    sched.abort_requests(["r2"])   # a member of the batch {r0, r1, r2} that is still waiting
    concurrent: list[set[str]] = []
    run_to_completion(sched, on_step=lambda out: concurrent.append({r.request_id for r in sched.running}))
    for running in concurrent:
        assert running <= {"r0", "r1"} or running <= {"r3", "r4", "r5"}
    assert all(r.num_output_tokens == 6 for r in reqs if r.request_id != "r2")


# ---------------------------------------------------------------------------- preemption

@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_of_the_newest_request_and_recompute(prefix_caching):
    bs = 4
    # Three 10-token prompts generating 20 tokens each: 29 tokens = 8 blocks each, 24 in all;
    # the pool has 12, so they cannot all grow.
    sched = make_scheduler(budget=64, max_num_seqs=8, block_size=bs, num_blocks=12, max_model_len=256,
                           prefix_caching=prefix_caching)
    prompts = [toks(i, 10) for i in range(3)]
    reqs = [make_request(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    preempted_events: list[str] = []
    resumed: list[tuple[str, int]] = []
    # Track (re)admissions: the computed length right when a preempted request comes back.
    runner = runner_of(sched)
    step = 0
    while sched.has_unfinished_requests():
        assert step < 1000
        before = [r.request_id for r in sched.running]
        out = sched.schedule()
        if out.preempted_req_ids:
            # The victims are the most recently admitted running requests.
            assert out.preempted_req_ids == before[::-1][:len(out.preempted_req_ids)]
            preempted_events.extend(out.preempted_req_ids)
        for s in scheduled(sched, out):
            r = s.request
            if r.request_id not in before and r.num_preemptions > 0:
                hit = r.num_computed_tokens
                resumed.append((r.request_id, hit))
                if prefix_caching:
                    assert hit % bs == 0 and hit <= (r.num_tokens - 1) // bs * bs
                else:
                    assert hit == 0
        runner.step(out)
        sched.kv.check_invariants()
        step += 1
    assert sched.stats.num_preemptions > 0 and preempted_events
    assert sched.stats.num_preemptions == len(preempted_events)
    assert resumed, "a preempted request never came back"
    # The oldest request is never the victim; everyone finishes with all its outputs, unchanged.
    assert "r0" not in preempted_events
    for r, p in zip(reqs, prompts):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(p, 20, True, 256)
    assert sum(r.num_preemptions for r in reqs) == len(preempted_events)
    assert sched.kv.num_owned_blocks() == 0 and not sched.kv.req_to_blocks
    if prefix_caching:
        # A resumed request finds (part of) its earlier KV in the prefix cache.
        assert any(hit > 0 for _, hit in resumed)


# ---------------------------------------------------------------------------- abort

def test_abort_frees_blocks_at_once_and_is_never_scheduled_again():
    sched = make_scheduler(budget=512, block_size=8, num_blocks=100, max_model_len=1024, prefix_caching=False)
    a = make_request("a", toks(1, 30), max_tokens=50)
    b = make_request("b", toks(2, 20), max_tokens=50)
    w = make_request("w", toks(3, 20), max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    runner = runner_of(sched)
    for _ in range(3):
        runner.step(sched.schedule())
    owned = sched.kv.num_owned_blocks()
    held_a = len(sched.kv.get_block_ids("a"))
    assert held_a == blocks_needed(a.num_computed_tokens, 8) > 0
    assert [r.request_id for r in sched.abort_requests(["a", "nope"])] == ["a"]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_owned_blocks() == owned - held_a
    assert sched.abort_requests(["a"]) == []  # twice is harmless
    # A waiting request is aborted too (it holds nothing).
    sched.add_request(w)
    sched.abort_requests(["w"])
    assert w.status == RequestStatus.FINISHED_ABORTED and not sched.waiting
    # Aborted between schedule and update: its result is dropped, its blocks are freed.
    out = sched.schedule()
    assert ids(out) == ["b"]
    sampled = runner.execute(out)
    sched.abort_requests(["b"])
    assert sched.kv.num_owned_blocks() == 0
    computed = b.num_computed_tokens
    assert sched.update_from_output(out, sampled) == []
    assert b.num_computed_tokens == computed and not sched.has_unfinished_requests()
    for _ in range(3):
        assert sched.schedule().is_empty
    sched.kv.check_invariants()


# ---------------------------------------------------------------------------- prefix caching

def test_prefix_cache_hit_across_requests():
    sched = make_scheduler(budget=2048, block_size=16, num_blocks=64, max_model_len=1024)
    prompt = toks(7, 64)
    first = make_request("first", prompt, max_tokens=4)
    sched.add_request(first)
    run_to_completion(sched)
    assert first.num_cached_tokens == 0
    hits_before = sched.stats.prefix_cache_hits
    second = make_request("second", prompt, max_tokens=4)
    sched.add_request(second)
    out = sched.schedule()
    # 64 tokens = 4 full blocks, but the last token must be computed: the 4th block is not reused.
    assert second.num_cached_tokens == 48 and second.num_computed_tokens == 48
    assert scheduled(sched, out)[0].num_new_tokens == 16
    assert sched.stats.prefix_cache_hits == hits_before + 48
    assert sched.stats.cached_prompt_tokens == 48
    runner_of(sched).step(out)
    run_to_completion(sched)
    assert second.output_token_ids == first.output_token_ids
    assert sched.kv.num_owned_blocks() == 0


def test_prefix_cache_shared_by_concurrent_requests():
    """Two running requests share the cached blocks of a common prefix (ref count 2)."""
    sched = make_scheduler(budget=2048, block_size=16, num_blocks=64, max_model_len=1024)
    system = toks(5, 40)
    a = make_request("a", system + toks(6, 5), max_tokens=6)
    sched.add_request(a)
    runner = runner_of(sched)
    runner.step(sched.schedule())
    b = make_request("b", system + toks(8, 9), max_tokens=6)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 32
    shared = set(sched.kv.get_block_ids("a")[:2])
    assert shared == set(sched.kv.get_block_ids("b")[:2])
    assert all(sched.kv.block_pool.blocks[i].ref_cnt == 2 for i in shared)
    runner.step(out)
    run_to_completion(sched)
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 6, True, 1024)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 6, True, 1024)
    assert sched.kv.num_owned_blocks() == 0


def test_eos_finishes_a_request_and_frees_it():
    sched = make_scheduler(budget=64, block_size=4, num_blocks=32, max_model_len=1024)
    # Find a prompt whose first generated token is EOS.
    prompt = next(p for p in (toks(s, 6) for s in range(10_000)) if next_token(p) == EOS)
    stopper = make_request("eos", prompt, max_tokens=10, ignore_eos=False)
    ignorer = make_request("ign", list(prompt), max_tokens=3, ignore_eos=True)
    sched.add_request(stopper)
    sched.add_request(ignorer)
    out = sched.schedule()
    touched = runner_of(sched).step(out)
    assert stopper in touched and stopper.status == RequestStatus.FINISHED_STOPPED
    assert stopper.output_token_ids == [EOS]
    assert sched.kv.get_block_ids("eos") == [] and stopper not in sched.running
    assert ignorer.status == RequestStatus.RUNNING
    run_to_completion(sched)
    assert ignorer.output_token_ids[0] == EOS and ignorer.num_output_tokens == 3
