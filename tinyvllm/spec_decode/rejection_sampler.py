"""Verification of draft tokens: which of a request's ``k`` drafts the target model accepts.

A request with drafts ``x_1..x_k`` is computed as a ``(k+1)``-token step; its ``k+1`` logits rows
give the target distributions ``p_0..p_k`` (``p_j`` is the next-token distribution after the
request's tokens and ``x_1..x_j``), each processed exactly as a plain step would process it
(banned ids, penalties, temperature, top-k, top-p, min-p: :meth:`Sampler.target_distribution`).

Speculative sampling (Leviathan et al., ICML 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", Algorithm 2) with a *deterministic* draft (the proposer's ``q`` is a
point mass at ``x_j``, as for vLLM's n-gram and suffix proposers): for ``j = 1..k`` in order,

* accept ``x_j`` with probability ``min(1, p_{j-1}(x_j) / q(x_j)) = p_{j-1}(x_j)``;
* at the first rejection, emit a token drawn from ``norm(max(0, p_{j-1} - q))``, i.e. ``p_{j-1}``
  with ``x_j`` removed and renormalised, and stop;
* if all ``k`` are accepted, emit a bonus token drawn from ``p_k``.

Each emitted token is then distributed exactly as ``p`` (the probability of emitting ``y`` at a
position is ``p(x) [y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y)``), so sampling with
speculation draws from the same distribution as without. A greedy row's ``p`` is the point mass
at its argmax: a draft is accepted iff it equals the argmax and the emitted token is the argmax,
so greedy output is token for token the non-speculative output.

Randomness: each random row draws one uniform for its acceptance test (rows with a draft) and one
for its recovery / bonus draw (:func:`~tinyvllm.sample.sampler.random_sample`), from the request's
own generator when it is seeded, so a seeded request's stream does not depend on its neighbours.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tinyvllm.sample.sampler import Sampler, SamplingMetadata, random_sample


def rejection_sample(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata,
                     drafts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Verify the drafts of a batch of requests.

    Args:
        sampler: the runner's sampler (its :meth:`~Sampler.target_distribution`).
        logits: ``[R, V]`` float, ``R = sum(len(d) + 1 for d in drafts)``: request ``i``'s
            ``len(drafts[i]) + 1`` rows are consecutive, in request order.
        md: sampling metadata of those ``R`` rows (row ``j`` of a request counts its drafts
            ``x_1..x_j`` among its output tokens, for penalties and ``min_tokens``).
        drafts: per request, its draft token ids (empty: a plain one-token sample).

    Returns:
        ``(tokens, rows)``: per request the emitted tokens (the accepted drafts, then one recovered
        or bonus token: ``1..len(draft) + 1`` tokens), and the logits row each was emitted from.
    """
    greedy_ids, random_rows, probs = sampler.target_distribution(logits, md)
    num_rows = logits.shape[0]
    starts, r = [], 0
    for d in drafts:
        starts.append(r)
        r += len(d) + 1
    if r != num_rows:
        raise ValueError(f"logits has {num_rows} rows, the drafts need {r}")
    row_token = greedy_ids.tolist()  # a greedy row's token (its argmax)
    accept: dict[int, bool] = {}  # random rows with a draft: the acceptance test's outcome
    if probs is not None:
        rows = random_rows.tolist()
        draft_of: list[int] = []
        for i, d in enumerate(drafts):
            draft_of.extend(d)
            draft_of.append(-1)
        dr = torch.tensor([draft_of[x] for x in rows], dtype=torch.int64, device=probs.device)
        gens = [md.generators[x] for x in rows]
        has = (dr >= 0).nonzero().squeeze(1)
        if has.numel():
            idx = has.tolist()
            u = torch.empty(len(idx), dtype=torch.float64, device=probs.device)
            unseeded = [j for j, x in enumerate(idx) if gens[x] is None]
            if unseeded:
                u[torch.tensor(unseeded, device=probs.device)] = torch.rand(len(unseeded), dtype=torch.float64,
                                                                           device=probs.device)
            for j, x in enumerate(idx):
                if gens[x] is not None:
                    u[j] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=gens[x])
            p_x = probs[has, dr[has]].double()
            ok = (u < p_x).tolist()
            for j, x in enumerate(idx):
                accept[rows[x]] = ok[j]
            probs = probs.clone()
            probs[has, dr[has]] = 0.0  # recovery distribution: p with the draft removed
        drawn = random_sample(probs, gens).tolist()
        for j, x in enumerate(rows):
            row_token[x] = drawn[j]
    tokens: list[list[int]] = []
    token_rows: list[list[int]] = []
    for d, s in zip(drafts, starts):
        out, out_rows = [], []
        for j, x in enumerate(d):
            row = s + j
            ok = accept[row] if row in accept else row_token[row] == x
            if not ok:
                break
            out.append(x)
            out_rows.append(row)
        else:
            j = len(d)
        out.append(row_token[s + j])  # the recovered token at the first rejection, or the bonus token
        out_rows.append(s + j)
        tokens.append(out)
        token_rows.append(out_rows)
    return tokens, token_rows
