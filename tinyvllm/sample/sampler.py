"""Batched sampler: one step's logits ``[B, V]`` -> one token id per row.

Order of operations (the same as vLLM v1's ``Sampler``):

1. **Raw logprobs** (only if some row asked for logprobs): ``log_softmax`` of the
   unmodified logits, upcast to float32.  Returned logprobs therefore describe
   the model's own distribution, before any penalty, temperature or truncation
   (vLLM v1's default, ``logprobs_mode="raw_logprobs"``).
2. **Banned token ids** -> ``-inf`` (the engine bans EOS / stop ids until a
   request reaches ``min_tokens``).
3. **Penalties**
   * repetition penalty, as in CTRL (Keskar et al. 2019, "CTRL: A Conditional
     Transformer Language Model for Controllable Generation", eq. in sec. 4.1)
     and Hugging Face's ``RepetitionPenaltyLogitsProcessor``: for every token
     that appears in the prompt *or* the output so far,
     ``logit / p if logit > 0 else logit * p``;
   * presence and frequency penalties, as in the OpenAI API reference
     ("Parameter details", frequency and presence penalties), over *generated*
     tokens only: ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
4. **Greedy rows** (temperature 0) take the argmax of the penalised logits.
5. **Random rows**: divide by temperature; top-k (keep logits >= the k-th largest);
   top-p / nucleus (Holtzman et al. 2019, "The Curious Case of Neural Text
   Degeneration": keep the smallest set of most-likely tokens whose cumulative
   probability is >= top_p, always keeping the most likely token); min-p (keep
   tokens with ``p >= min_p * p_max``); softmax; then draw.

Drawing is by inversion (see :func:`random_sample`): one uniform per row against
the row's cumulative probabilities. A row whose request has its own
``torch.Generator`` draws its uniform from that generator only, so it consumes
exactly one draw per step whatever else is in the batch, and a seeded request gets
the same tokens alone or in any batch.  Rows without a generator share one batched
draw from torch's default generator.

Fast paths: an all-greedy batch is a bare argmax (no softmax, no sort);
penalties are skipped when no row has one; top-k and top-p use ``torch.topk``
(no full-vocabulary sort; top-p sorts a row only when its nucleus is wider than
``TOP_P_CANDIDATES`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tinyvllm.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step, per-row sampling inputs for a batch of ``B`` rows.

    Tensors live on the logits' device. ``generators[i]``, when not None, must be a
    ``torch.Generator`` on that same device (see :func:`make_generator`).
    """

    temperature: torch.Tensor        # [B] float32; 0.0 for greedy rows
    top_p: torch.Tensor              # [B] float32; 1.0 = disabled
    top_k: torch.Tensor              # [B] int64; 0 = disabled
    min_p: torch.Tensor              # [B] float32; 0.0 = disabled
    repetition_penalty: torch.Tensor  # [B] float32; 1.0 = disabled
    presence_penalty: torch.Tensor   # [B] float32; 0.0 = disabled
    frequency_penalty: torch.Tensor  # [B] float32; 0.0 = disabled
    generators: list[torch.Generator | None]  # per row: a seeded request's own generator, else None
    prompt_token_ids: list[list[int]]         # per row
    output_token_ids: list[list[int]]         # per row: tokens generated so far
    banned_token_ids: list[list[int]]         # per row: ids forced to -inf this step
    max_num_logprobs: int | None              # max over rows of SamplingParams.logprobs; None if none asked
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k_top_p_min_p: bool
    # Finer flags over the random rows; the safe default (False) means "check the tensor".
    no_top_k: bool = False
    no_top_p: bool = False
    no_min_p: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[list[int]],
        output_token_ids: Sequence[list[int]],
        generators: Sequence[torch.Generator | None],
        banned_token_ids: Sequence[list[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Collect the per-row parameters of ``params`` (length ``B``) into tensors."""
        b = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == b):
            raise ValueError(
                "params, prompt_token_ids, output_token_ids and generators must all have "
                f"length {b}, got {len(prompt_token_ids)}, {len(output_token_ids)}, {len(generators)}"
            )
        if banned_token_ids is None:
            banned = [[] for _ in range(b)]
        else:
            if len(banned_token_ids) != b:
                raise ValueError(f"banned_token_ids must have length {b}, got {len(banned_token_ids)}")
            banned = [list(ids) for ids in banned_token_ids]

        greedy = [p.is_greedy for p in params]
        random_params = [p for p, g in zip(params, greedy) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        no_top_k = all(p.top_k == 0 for p in random_params)
        no_top_p = all(p.top_p >= 1.0 for p in random_params)
        no_min_p = all(p.min_p == 0.0 for p in random_params)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=f32([0.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_p=f32([p.top_p for p in params]),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            min_p=f32([p.min_p for p in params]),
            repetition_penalty=f32([p.repetition_penalty for p in params]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            generators=list(generators),
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            banned_token_ids=banned,
            max_num_logprobs=max(wanted) if wanted else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=not any(p.has_penalties for p in params),
            no_top_k_top_p_min_p=no_top_k and no_top_p and no_min_p,
            no_top_k=no_top_k,
            no_top_p=no_top_p,
            no_min_p=no_min_p,
        )


@dataclass
class LogprobsTensors:
    """Logprobs of one step, under the model's raw (unmodified) distribution."""

    sampled_logprob: torch.Tensor  # [B] float32: logprob of the sampled token
    sampled_rank: torch.Tensor     # [B] int64: 1-based rank of the sampled token (1 = most likely)
    topk_ids: torch.Tensor         # [B, max_num_logprobs] int64, most likely first
    topk_logprobs: torch.Tensor    # [B, max_num_logprobs] float32


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None = field(default=None)  # set when md.max_num_logprobs is not None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator, seeded with ``seed``, on the logits' device."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


# ---------------------------------------------------------------------------
# Building blocks (each takes and returns float32 logits [b, V]; exposed for tests)
# ---------------------------------------------------------------------------


def compute_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprob and rank of ``sampled`` ``[B]`` plus the top ``num_logprobs`` under ``raw_logprobs`` ``[B, V]``.

    The rank is 1 + the number of tokens with a strictly greater logprob.
    """
    sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    sampled_rank = (raw_logprobs > sampled_logprob).sum(dim=1) + 1
    topk_logprobs, topk_ids = torch.topk(raw_logprobs, num_logprobs, dim=1)
    return LogprobsTensors(
        sampled_logprob=sampled_logprob.squeeze(1),
        sampled_rank=sampled_rank.to(torch.int64),
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
    )


def _ragged_to_padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``rows`` (ragged ids) -> ``[len(rows), max_len]`` int64 padded with ``pad``."""
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrence counts ``[len(rows), V]`` int64 of each token id in each row's list."""
    ids = _ragged_to_padded(rows, vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set to ``-inf`` the logits of tokens a grammar forbids, in place; returns ``logits``.

    Args:
        logits: ``[B, V]`` float.
        bitmask: ``[R, W]`` int32 with ``W = ceil(V' / 32)``, ``V' >= V``: bit ``t % 32`` of word
            ``t // 32`` of row ``r`` set = token ``t`` allowed (xgrammar's layout). Tokens past the
            bitmask's width, if ``V > 32 * W``, are forbidden.
        rows: ``[R]`` int64, the row of ``logits`` each bitmask row applies to (None: rows ``0..R-1``).

    Rows not named are left bit-for-bit unchanged. On the CPU, contiguous float32 logits go through
    the C++ kernel ``apply_token_bitmask`` (``cpu_sample.cpp``: one AVX-512 masked store of -inf per
    16 logits; at [16, 49152] 0.6 ms against 6-10 ms for xgrammar's CPU kernel
    ``apply_token_bitmask_inplace`` in the same run, and ~30 ms for the torch unpacking below, all
    on a loaded 2-core machine); otherwise (CUDA, no C++ build) torch ops.
    """
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        from tinyvllm.kernels.cpu import cpu_kernels

        kern = cpu_kernels()
        if kern is not None and hasattr(kern, "apply_token_bitmask"):
            idx = torch.arange(bitmask.shape[0], dtype=torch.int64) if rows is None else rows.to(torch.int64)
            kern.apply_token_bitmask(logits, bitmask.to(torch.int32).contiguous(), idx.contiguous())
            return logits
    return apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                              rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`apply_token_bitmask` in torch ops (any device, dtype and layout); same arguments."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)  # [R, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device)
    if rows is None:
        logits[: bitmask.shape[0]].masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set ``logits[i, banned_token_ids[i]] = -inf`` in place; returns ``logits``."""
    rows: list[int] = []
    cols: list[int] = []
    for i, ids in enumerate(banned_token_ids):
        rows.extend([i] * len(ids))
        cols.extend(ids)
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float(
            "-inf"
        )
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition (CTRL / HF), then frequency and presence (OpenAI) penalties.

    Args:
        logits: ``[B, V]`` float32 (not modified; a new tensor is returned).
        prompt_token_ids, output_token_ids: ``B`` lists of token ids.
        repetition_penalty, presence_penalty, frequency_penalty: ``[B]`` float32.

    Rows with neutral values (1, 0, 0) are left bit-for-bit unchanged.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    output_counts = token_counts(output_token_ids, vocab_size, device)

    if bool((repetition_penalty != 1.0).any()):
        seen = (token_counts(prompt_token_ids, vocab_size, device) > 0) | (output_counts > 0)
        p = repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)

    if bool((presence_penalty != 0.0).any() | (frequency_penalty != 0.0).any()):
        logits = logits - (
            frequency_penalty.unsqueeze(1) * output_counts
            + presence_penalty.unsqueeze(1) * (output_counts > 0)
        )
    return logits


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= each row's k-th largest (ties at the k-th are kept); no full sort.

    Args:
        logits: ``[b, V]`` float32.
        top_k: ``[b]`` int64, 0 = disabled for that row.
    """
    vocab_size = logits.shape[1]
    k = top_k.clamp(max=vocab_size)
    disabled = k <= 0
    k_max = int(k.max())
    if k_max <= 0:
        return logits
    top_values = torch.topk(logits, k_max, dim=1).values  # [b, k_max], descending
    kth = top_values.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))  # [b, 1]
    kth = kth.masked_fill(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


TOP_P_CANDIDATES = 1024
"""Candidates :func:`apply_top_k_top_p` takes with ``torch.topk`` before it falls back to a full sort."""


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p (nucleus) truncation; masked logits become ``-inf``.

    Args:
        logits: ``[b, V]`` float32 (already divided by temperature).
        top_k: ``[b]`` int64 (0 = disabled) or None when no row uses it.
        top_p: ``[b]`` float32 (1.0 = disabled) or None when no row uses it.

    Top-k keeps the logits ``>=`` the row's k-th largest (ties at the k-th are kept). Top-p
    (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", sec. 3.1) keeps the
    smallest prefix of the descending-probability order (ties by token id) whose cumulative
    probability is ``>= top_p``; the most likely token is always kept.

    The nucleus is found among the row's ``TOP_P_CANDIDATES`` largest logits (``torch.topk``,
    then ordered by value and token id), with probabilities ``exp(x - logsumexp(row))`` over the
    whole row. That is exact whenever the cut falls before the smallest candidate value (every
    token at or above the cut is then a candidate); a row where it does not (a flat distribution)
    is truncated by a full sort instead (:func:`_top_p_by_sort`). At ``[16, 49152]`` on two Zen 4
    cores the candidate path takes a few ms where the full sort took ~45 ms. Which path a row
    takes depends on that row alone, so the result stays batch-invariant.
    """
    if top_k is not None:
        logits = apply_top_k_only(logits, top_k)
    if top_p is None:
        return logits

    vocab_size = logits.shape[1]
    n_cand = min(vocab_size, TOP_P_CANDIDATES)
    values, ids = torch.topk(logits, n_cand, dim=1)  # descending; tie order unspecified
    ids, by_id = ids.sort(dim=1)
    values, by_value = values.gather(1, by_id).sort(dim=1, descending=True, stable=True)
    ids = ids.gather(1, by_value)  # [b, n_cand]: descending value, ties by token id
    drop = _nucleus_drop((values - torch.logsumexp(logits, dim=1, keepdim=True)).exp(), top_p)
    nucleus = (top_p < 1.0).unsqueeze(1)
    n_kept = (~drop).sum(dim=1)  # [b]; >= 1, position 0 has mass 0
    # Exact when every kept candidate lies above the smallest candidate value (whose ties may
    # continue past the candidates), or when the candidates are the whole row.
    last_kept = values.gather(1, (n_kept - 1).unsqueeze(1)).squeeze(1)
    exact = (last_kept > values[:, -1]) | (n_cand == vocab_size)
    out = logits.masked_fill(nucleus, float("-inf"))  # nucleus rows: only kept candidates return
    out.scatter_(1, ids, values.masked_fill(drop, float("-inf")))  # rows without top-p: their own values
    if not bool(exact.all()):
        rows = (~exact).nonzero().squeeze(1)
        out[rows] = _top_p_by_sort(logits[rows], top_p[rows])
    return out


def _nucleus_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` bool: the positions top-p drops, given ``probs`` in descending order per row.

    A position is dropped once the probability of all earlier positions reaches ``top_p``
    (position 0 has mass 0, so it is always kept); rows with ``top_p == 1`` drop nothing, which
    guards against float rounding in the cumulative sum.
    """
    mass_before = probs.cumsum(dim=1) - probs
    return (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p of :func:`apply_top_k_top_p` by a full stable sort of each row (``[b, V]`` float32)."""
    sorted_logits, order = torch.sort(logits, dim=1, descending=True, stable=True)
    drop = _nucleus_drop(sorted_logits.softmax(dim=1), top_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * p_max`` (``min_p`` ``[b]``; 0 = disabled)."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[b, V]`` by inversion; returns ``[b]`` int64.

    Inverse-transform sampling (Devroye 1986, "Non-Uniform Random Variate Generation",
    sec. 2.1, the inversion method): with ``u ~ U[0, 1)`` one float64 per row, the token
    is the first ``i`` whose cumulative probability ``C_i = p_0 + ... + p_i`` (float64) exceeds
    ``u * C_{V-1}``. Tokens with ``p_i == 0`` are never drawn: ``C_i > u * C`` needs ``C_i >
    C_{i-1}``, and a target that rounds up to the total falls back to the last token with mass.

    Row ``i`` with ``generators[i]`` set draws its one uniform from that generator alone, so
    it consumes one draw per step whatever else is in the batch; the other rows share one
    batched draw from torch's default generator. Each row's cumulative sum is a sequential
    pass over that row only, so a seeded row's token does not depend on the batch.

    Cost at [16, 49152] on two Zen 4 cores: ~3 ms, against ~15 ms for the ``V`` exponentials
    per row that the exponential race (``argmax p_i / q_i``, ``q_i ~ Exp(1)``) draws with
    ``Tensor.exponential_``; that draw made a sampled decode step up to ~20 ms slower than a
    greedy one.
    """
    b, _ = probs.shape
    u = torch.empty(b, 1, dtype=torch.float64, device=probs.device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < b:
        if not seeded:
            u.uniform_()
        else:
            unseeded = [i for i, g in enumerate(generators) if g is None]
            idx = torch.tensor(unseeded, device=probs.device)
            u[idx] = torch.rand(len(unseeded), 1, dtype=torch.float64, device=probs.device)
    for i in seeded:
        u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generators[i])
    cdf = probs.cumsum(dim=1, dtype=torch.float64)  # [b, V]
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u * total, right=True)  # first C_i > u * C
    last_with_mass = torch.searchsorted(cdf, total, right=False)  # first C_i == C
    return torch.minimum(picked, last_with_mass).squeeze(1)


class Sampler:
    """Turns a step's logits into token ids; see the module docstring for the order of operations."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` float32 (bf16/fp16 are upcast). Not modified.
            md: the batch's :class:`SamplingMetadata`.

        Returns:
            :class:`SamplerOutput` with ``sampled_token_ids`` ``[B]`` int64 and, when
            ``md.max_num_logprobs`` is not None, raw-distribution logprobs.
        """
        caller_logits = logits
        if logits.dtype != torch.float32:
            logits = logits.float()

        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=1)

        logits = self._ban_and_penalise(logits, md, copy=logits is caller_logits)

        if md.all_greedy:
            sampled = logits.argmax(dim=1)
        else:
            sampled = self._sample(logits, md)

        logprobs = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            logprobs = compute_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _ban_and_penalise(logits: torch.Tensor, md: SamplingMetadata, copy: bool) -> torch.Tensor:
        """Steps 2-3 of the module docstring: banned ids to -inf, then the penalties (``copy``: do not
        modify ``logits`` in place)."""
        if any(md.banned_token_ids):
            if copy:
                logits = logits.clone()
            logits = apply_banned_tokens(logits, md.banned_token_ids)
        if not md.no_penalties:
            logits = apply_penalties(
                logits,
                md.prompt_token_ids,
                md.output_token_ids,
                md.repetition_penalty,
                md.presence_penalty,
                md.frequency_penalty,
            )
        return logits

    def target_distribution(self, logits: torch.Tensor, md: SamplingMetadata
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The distribution each row would be sampled from, for speculative verification.

        Applies exactly what :meth:`__call__` applies before its draw (banned ids, penalties; for
        random rows temperature, top-k, top-p, min-p), so accepting a draft token ``x`` with
        probability ``probs[i, x]`` verifies against the same distribution a plain step samples.

        Args:
            logits: ``[B, V]`` float32 (bf16/fp16 are upcast). Not modified.
            md: the rows' :class:`SamplingMetadata`.

        Returns:
            ``greedy_ids`` ``[B]`` int64 (argmax of the penalised logits: the token of a greedy row),
            ``random_rows`` ``[b]`` int64 (rows with temperature > 0), and ``probs`` ``[b, V]``
            float32 of those rows (None when ``b == 0``).
        """
        caller_logits = logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        logits = self._ban_and_penalise(logits, md, copy=logits is caller_logits)
        greedy_ids = logits.argmax(dim=1)
        random_rows = (md.temperature >= SAMPLING_EPS).nonzero().squeeze(1)
        if random_rows.numel() == 0:
            return greedy_ids, random_rows, None
        x = logits[random_rows] / md.temperature[random_rows].unsqueeze(1)
        if not md.no_top_k_top_p_min_p:
            top_k = None if md.no_top_k else md.top_k[random_rows]
            top_p = None if md.no_top_p else md.top_p[random_rows]
            if top_k is not None or top_p is not None:
                x = apply_top_k_top_p(x, top_k, top_p)
            if not md.no_min_p:
                x = apply_min_p(x, md.min_p[random_rows])
        return greedy_ids, random_rows, x.softmax(dim=1)

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Mixed or all-random batch: greedy rows argmax, random rows are truncated and drawn."""
        if md.all_random:
            rows = None
            x = logits
            generators = md.generators
        else:
            random_mask = md.temperature >= SAMPLING_EPS
            rows = random_mask.nonzero().squeeze(1)
            if rows.numel() == 0:
                return logits.argmax(dim=1)
            x = logits[rows]
            generators = [md.generators[i] for i in rows.tolist()]

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t[rows]

        x = x / pick(md.temperature).unsqueeze(1)
        if not md.no_top_k_top_p_min_p:
            top_k = None if md.no_top_k else pick(md.top_k)
            top_p = None if md.no_top_p else pick(md.top_p)
            if top_k is not None or top_p is not None:
                x = apply_top_k_top_p(x, top_k, top_p)
            if not md.no_min_p:
                x = apply_min_p(x, pick(md.min_p))
        random_tokens = random_sample(x.softmax(dim=1), generators)

        if rows is None:
            return random_tokens
        sampled = logits.argmax(dim=1)
        sampled[rows] = random_tokens
        return sampled
