"""When to speculate: a cost model from measured step times (``cost_model: true``, the default).

A verification step with ``k`` drafts adds ``k`` rows to the forward. On a CPU a one-stream decode
step is bound by streaming the weights, so a few extra rows cost little; at a batch of 16 the step
is compute-bound and every extra row costs real time. The rule:

* **Step time model.** ``t(T) = a + b T`` seconds for a step of ``T`` scheduled tokens, fitted by
  least squares over the last ``window`` steps' measured forward + sampling times. Until the steps
  seen span at least two distinct ``T``, ``b`` is the prior ``a / PRIOR_ROWS_PER_STEP_TIME`` (the
  step would double in time at that many extra rows; pessimistic for a one-stream CPU decode).
* **Acceptance model.** Each request's per-token acceptance ``alpha`` is an exponential moving
  average over its verified drafts (``Request.spec_acceptance``); a request not yet verified
  uses the engine-wide average (prior 0.5). Draft token ``j`` (1-based) is accepted only if all
  before it are, so its expected yield is ``alpha ** j`` tokens.
* **Choice.** A step yields ``E`` expected tokens in ``t(T)`` seconds. Adding a draft token with
  yield ``g`` raises throughput iff ``(E + g) / (t + b) > E / t``, i.e. ``g * t > b * E``. Candidate
  draft tokens (every request's, in decreasing yield) are added while that holds, starting from
  the plain step (``E`` = the decoding requests, ``T`` = them plus the last step's prefill tokens).
  This maximises expected tokens per second of the step; at batch 1 that is TPOT.
* **Exploration.** A request whose drafts were turned off is still given one draft token when it
  has gone ``gap`` steps without a verification while its proposer had a draft, so a falling
  ``alpha`` can recover (:class:`ExploreBackoff`). ``gap`` starts at ``EXPLORE_EVERY`` and backs
  off exponentially: it doubles on every explored draft token that is rejected, up to
  ``EXPLORE_MAX_EVERY``, and returns to ``EXPLORE_EVERY`` as soon as one of the request's verified
  draft tokens is accepted. On text that drafts never match (sampled chat at a batch of 16), a
  request explores about ``log2(N / EXPLORE_EVERY)`` times in its first ``N`` steps instead of
  ``N / EXPLORE_EVERY``; each explored row is a row of a compute-bound step. A request whose text
  turns repetitive later is explored again within ``EXPLORE_MAX_EVERY`` steps, and its first
  accepted token brings the interval back to ``EXPLORE_EVERY``.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

PRIOR_ROWS_PER_STEP_TIME = 32.0
EXPLORE_EVERY = 16
EXPLORE_MAX_EVERY = 256
PRIOR_ACCEPTANCE = 0.5


class SpecPolicy:
    """Chooses each request's draft length for the next step.

    Args:
        window: steps kept for the step-time fit.
        disable_by_batch_size: no drafts at all when this many requests (or more) are running
            (vLLM's ``disable_by_batch_size``); None: never by batch size.
        cost_model: False: every draft at its full length (only ``disable_by_batch_size`` applies).
    """

    def __init__(self, window: int = 256, disable_by_batch_size: int | None = None, cost_model: bool = True) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.disable_by_batch_size = disable_by_batch_size
        self.cost_model = cost_model
        self.global_acceptance = PRIOR_ACCEPTANCE
        self.num_steps = 0
        self.last_explored: list[bool] = []  # per candidate of the last choose(): verified only to explore

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Record a step of ``num_tokens`` scheduled tokens that took ``seconds`` (forward + sampling)."""
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def observe_acceptance(self, rate: float) -> None:
        """Record one verification's per-token acceptance (for requests not yet verified)."""
        self.global_acceptance = 0.95 * self.global_acceptance + 0.05 * rate

    def step_time_model(self) -> tuple[float, float] | None:
        """``(a, b)`` seconds of ``t(T) = a + b T``, or None before any step was measured."""
        n = len(self.samples)
        if n == 0:
            return None
        xs = [x for x, _ in self.samples]
        ys = [y for _, y in self.samples]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx > 0:
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
            if b > 0:
                a = my - b * mx
                if a > 0:
                    return a, b
        # one distinct T (or a fit without meaning): the prior slope through the mean
        a = my / (1.0 + mx / PRIOR_ROWS_PER_STEP_TIME)
        return a, a / PRIOR_ROWS_PER_STEP_TIME

    def choose(self, num_running: int, base_tokens: int, candidates: Sequence[tuple[int, float | None, bool]]
               ) -> list[int]:
        """Draft lengths for the next step.

        Args:
            num_running: requests running now.
            base_tokens: tokens the next step computes without drafts (decodes + prefill chunks).
            candidates: per decoding request with a draft: ``(draft length, its acceptance estimate or
                None, whether it may explore this step)``.
        Returns:
            per candidate, how many of its draft tokens to verify (0: none).
        """
        self.num_steps += 1
        self.last_explored = [False] * len(candidates)
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return [0] * len(candidates)
        if not self.cost_model:
            return [n for n, _, _ in candidates]
        model = self.step_time_model()
        if model is None:
            return [min(n, 1) for n, _, _ in candidates]  # nothing measured yet: one token each
        a, b = model
        tokens = max(base_tokens, len(candidates))
        expected = float(max(num_running, 1))
        items = []
        for i, (n, alpha, _) in enumerate(candidates):
            al = self.global_acceptance if alpha is None else alpha
            g = 1.0
            for j in range(n):
                g *= al
                items.append((g, i))
        items.sort(key=lambda t: -t[0])
        out = [0] * len(candidates)
        for g, i in items:
            if g * (a + b * tokens) <= b * expected:
                break
            out[i] += 1
            tokens += 1
            expected += g
        for i, (n, _, explore) in enumerate(candidates):
            if out[i] == 0 and explore and n:
                out[i] = 1
                self.last_explored[i] = True
        return out


class ExploreBackoff:
    """When each request may explore: exponential back-off of the exploration interval.

    Classic binary exponential back-off (as Ethernet's retransmissions after collisions, or TCP's
    retransmission timer): every failed probe doubles the wait before the next, up to a cap, and a
    success resets it. Here a probe is one draft token verified only to re-measure a request's
    acceptance (:meth:`SpecPolicy.choose`'s ``explore``). vLLM and SGLang have no such rule (vLLM turns
    drafts off by batch size; SGLang's n-gram speculation has fixed draft counts); this is tinyvllm's.

    Per request: ``idle`` counts the steps in which its proposer had a draft but none was verified;
    the request may explore when ``idle >= gap``. ``gap`` doubles (up to ``cap``) each time an explored
    draft token is rejected, and returns to ``base`` whenever a verification of the request accepts a
    token, explored or not.

    Per proposer (this object; one per engine): a new request's first ``gap`` is ``shared_gap``, which
    doubles the same way on every rejected exploration of any request and returns to ``base`` on any
    accepted draft token. While the proposer's drafts are rejected everywhere (sampled chat), new
    requests start backed off instead of each paying ``log2`` explorations of its own; one accepted
    token anywhere restores ``base`` for the requests that arrive next. (A new request's drafts do not
    wait for this when the cost model takes them: one not yet verified is sized by the engine-wide
    acceptance.)

    Args:
        base: the first (and reset) interval, steps.
        cap: the longest interval, steps.
    """

    def __init__(self, base: int = EXPLORE_EVERY, cap: int = EXPLORE_MAX_EVERY) -> None:
        self.base, self.cap = base, cap
        self.idle: dict[str, int] = {}
        self.gap: dict[str, int] = {}
        self.shared_gap = base
        self.exploring: set[str] = set()  # requests whose drafts in the step being run are an exploration
        self.num_explored = 0  # explorations scheduled, in all

    def due(self, rid: str) -> bool:
        """Whether the request may explore in the next step."""
        gap = self.gap.get(rid)
        if gap is None:
            gap = self.gap[rid] = self.shared_gap
        return self.idle.get(rid, 0) >= gap

    def step(self, rid: str, num_verified: int, explored: bool) -> None:
        """The next step verifies ``num_verified`` (0: none) of the request's draft tokens; ``explored``:
        only to explore (the cost model alone would verify none)."""
        if num_verified:
            self.idle[rid] = 0
            if explored:
                self.exploring.add(rid)
                self.num_explored += 1
        else:
            self.idle[rid] = self.idle.get(rid, 0) + 1

    def outcome(self, rid: str, num_accepted: int) -> None:
        """A verification of the request's drafts accepted ``num_accepted`` tokens."""
        explored = rid in self.exploring
        self.exploring.discard(rid)
        known = rid in self.idle  # not finished meanwhile
        if num_accepted:
            self.shared_gap = self.base
            if known:
                self.gap[rid] = self.base
        elif explored:
            self.shared_gap = min(2 * self.shared_gap, self.cap)
            if known:
                self.gap[rid] = min(2 * self.gap.get(rid, self.base), self.cap)

    def forget(self, rid: str) -> None:
        self.idle.pop(rid, None)
        self.gap.pop(rid, None)
        self.exploring.discard(rid)

    def keep_only(self, live: set[str]) -> None:
        """Drop the state of requests no longer running (aborted)."""
        self.idle = {k: v for k, v in self.idle.items() if k in live}
        self.gap = {k: v for k, v in self.gap.items() if k in live}
        self.exploring &= live
