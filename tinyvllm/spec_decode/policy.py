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
* **Exploration.** A request whose drafts were turned off is still given one draft token every
  ``EXPLORE_EVERY`` steps where its proposer has one, so a falling ``alpha`` can recover.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

PRIOR_ROWS_PER_STEP_TIME = 32.0
EXPLORE_EVERY = 16
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
        return out
