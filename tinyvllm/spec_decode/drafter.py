"""The engine core's side of speculative decoding: propose drafts for the running requests between
steps, cut them by grammar and by the cost model, and learn from each verification.

:class:`Drafter` is called by :class:`~tinyvllm.engine.core.EngineCore` after every step's
``update_from_output``: for every request that is decoding (its next step computes exactly its
newest token), the proposer (:class:`~tinyvllm.spec_decode.ngram_proposer.NgramProposer` or
:class:`~tinyvllm.spec_decode.suffix_proposer.SuffixProposer`) drafts up to
``num_speculative_tokens`` tokens; a request with a grammar keeps only the prefix its grammar
accepts (vLLM validates drafts the same way); :class:`~tinyvllm.spec_decode.policy.SpecPolicy`
chooses how many of each to verify. The drafts go in ``Request.spec_token_ids``; the scheduler
turns them into a ``(k+1)``-token step. Proposing runs on the engine core's CPU thread between
steps; its time is summed in ``SchedulerStats.spec_decode_propose_seconds``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from tinyvllm.config import SpeculativeConfig
from tinyvllm.request import Request, RequestStatus
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.spec_decode.policy import ExploreBackoff, SpecPolicy
from tinyvllm.spec_decode.suffix_proposer import SuffixProposer


class _TokenBuffer:
    """A request's tokens as a growing int64 array (appended to, never rebuilt per step)."""

    __slots__ = ("arr", "n")

    def __init__(self) -> None:
        self.arr = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        m = len(tokens)
        if m < self.n:  # never happens (tokens only grow); rebuild to be safe
            self.n = 0
        if m > len(self.arr):
            grown = np.empty(max(m, 2 * len(self.arr)), dtype=np.int64)
            grown[:self.n] = self.arr[:self.n]
            self.arr = grown
        if m > self.n:
            self.arr[self.n:m] = tokens[self.n:m]
            self.n = m
        return self.arr[:m]


class Drafter:
    """Proposes, validates and sizes each decoding request's drafts (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        if config.method == "ngram":
            self.proposer: Any = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        else:
            self.proposer = SuffixProposer(max_depth=config.suffix_decoding_max_tree_depth,
                                           max_cached_requests=config.suffix_decoding_max_cached_requests,
                                           max_spec_factor=config.suffix_decoding_max_spec_factor,
                                           min_token_prob=config.suffix_decoding_min_token_prob)
        self.policy = SpecPolicy(disable_by_batch_size=config.disable_by_batch_size, cost_model=config.cost_model)
        self._buffers: dict[str, _TokenBuffer] = {}
        self.backoff = ExploreBackoff()  # when each request may explore (exponential back-off)

    def _propose_one(self, req: Request) -> list[int]:
        if self.config.method == "ngram":
            buf = self._buffers.get(req.request_id)
            if buf is None:
                buf = self._buffers[req.request_id] = _TokenBuffer()
            return self.proposer.propose(buf.sync(req.all_token_ids), self.k)
        return self.proposer.propose(req.request_id, req.prompt_token_ids, req.output_token_ids, self.k)

    @staticmethod
    def _grammar_prefix(req: Request, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the request's grammar accepts (the grammar is left as it was)."""
        g = req.grammar
        g.sync(req.output_token_ids)
        n = 0
        for t in draft:
            if g.is_terminated() or not g.accept_token(t):
                break
            n += 1
        if n:
            g.rollback(n)
        return draft[:n]

    def propose(self, running: Sequence[Request], base_tokens: int) -> float:
        """Set ``spec_token_ids`` of every running request; returns the seconds it took.

        Args:
            running: the scheduler's running requests.
            base_tokens: tokens the next step computes without drafts (for the cost model).
        """
        t0 = time.perf_counter()
        cands: list[tuple[Request, list[int]]] = []
        for req in running:
            req.spec_token_ids = []
            if req.status != RequestStatus.RUNNING or req.num_computed_tokens + 1 != req.num_tokens:
                continue  # not decoding next step
            room = min(self.k, req.max_tokens - req.num_output_tokens - 1)
            if room <= 0:
                continue
            draft = self._propose_one(req)[:room]
            if draft and req.grammar is not None:
                draft = self._grammar_prefix(req, draft)
            if draft:
                cands.append((req, draft))
        backoff = self.backoff
        backoff.exploring.clear()  # the last step's verifications were observed (or never ran)
        if cands:
            pol = self.policy
            lengths = pol.choose(len(running), base_tokens,
                                 [(len(d), r.spec_acceptance, backoff.due(r.request_id)) for r, d in cands])
            for (req, draft), n, explored in zip(cands, lengths, pol.last_explored):
                if n:
                    req.spec_token_ids = draft[:n]
                backoff.step(req.request_id, n, explored)
        if len(self._buffers) > 2 * len(running) + 16 or len(backoff.idle) > 2 * len(running) + 16:
            live = {r.request_id for r in running}  # drop the state of requests aborted meanwhile
            self._buffers = {k: v for k, v in self._buffers.items() if k in live}
            backoff.keep_only(live)
        if self.config.method == "suffix":
            self.proposer.prune({r.request_id for r in running})
        return time.perf_counter() - t0

    def observe(self, num_tokens: int, seconds: float, verified: dict[str, list[int]],
                accepted: dict[str, list[int]]) -> None:
        """Learn from a finished step: its size and time, and each verification's acceptance.

        Args:
            num_tokens: tokens the step computed (0: a step not to fit the time model by, one with
                prefill); seconds: its forward + sampling time.
            verified: request id -> drafts verified; accepted: request id -> drafts accepted.
        """
        self.policy.observe_step(num_tokens, seconds)
        for rid, d in verified.items():
            acc = len(accepted.get(rid, ()))
            self.policy.observe_acceptance(acc / min(len(d), acc + 1))
            self.backoff.outcome(rid, acc)

    def finish(self, req: Request) -> None:
        """A request finished: forget its state (the suffix method adds its output to the global tree)."""
        self._buffers.pop(req.request_id, None)
        self.backoff.forget(req.request_id)
        if self.config.method == "suffix":
            self.proposer.finish(req.request_id, req.output_token_ids)
