"""Tests of the batched sampler: greedy, distributions, penalties, seeds, bans, logprobs.

Distribution tests are statistical (chi-square plus per-token z-scores against the
expected probabilities computed independently in float64), not snapshots; the
default generator is seeded so each run is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch

from tinyvllm.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    make_generator,
)
from tinyvllm.sampling_params import SamplingParams

V = 24
# A fixed, well-spread logits vector (no ties), in float32.
LOGITS = torch.tensor(
    [2.3, -0.4, 1.1, 0.05, -1.7, 3.0, 0.6, -0.9, 1.8, -2.5, 0.0, 1.4,
     -0.2, 2.7, -1.2, 0.9, -3.1, 0.3, 1.6, -0.6, 2.0, -1.5, 0.45, -2.1],
    dtype=torch.float32,
)
N_SAMPLES = 20_000
sampler = Sampler()


def build(
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    banned: Sequence[list[int]] | None = None,
) -> SamplingMetadata:
    b = len(params)
    return SamplingMetadata.build(
        list(params),
        prompt_token_ids=list(prompts) if prompts is not None else [[] for _ in range(b)],
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(b)],
        generators=list(generators) if generators is not None else [None] * b,
        banned_token_ids=banned,
    )


def draw(params: SamplingParams, n: int = N_SAMPLES, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """``n`` independent samples: one batch of ``n`` identical rows (shared default generator)."""
    torch.manual_seed(1234)
    md = build([params] * n)
    return sampler(logits.expand(n, -1).contiguous(), md).sampled_token_ids


def softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation (z=4.75: p ~ 1e-6)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_distribution(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """Samples must never hit zero-probability tokens and must fit ``expected`` statistically."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    zero = expected == 0
    assert counts[zero].sum() == 0, f"sampled excluded tokens {torch.nonzero(zero & (counts > 0)).tolist()}"

    p = expected[~zero]
    c = counts[~zero]
    # Per-token z-score: |p_hat - p| within 5 standard errors.
    se = torch.sqrt(p * (1 - p) / n)
    z = (c / n - p).abs() / se.clamp(min=1e-12)
    assert float(z.max()) < 5.0, f"max z-score {float(z.max()):.2f}: freq {(c / n).tolist()} vs {p.tolist()}"
    # Chi-square goodness of fit, merging bins with expected count < 5.
    small = n * p < 5
    exp_bins = torch.cat([n * p[~small], (n * p[small]).sum().reshape(1)])
    obs_bins = torch.cat([c[~small], c[small].sum().reshape(1)])
    if not bool(small.any()):
        exp_bins, obs_bins = exp_bins[:-1], obs_bins[:-1]
    df = exp_bins.numel() - 1
    if df >= 1:
        chi2 = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
        assert chi2 < chi2_critical(df), f"chi2={chi2:.1f} >= {chi2_critical(df):.1f} (df={df})"


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    md = build([SamplingParams(temperature=0.0)] * 6)
    assert md.all_greedy and not md.all_random
    out = sampler(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.logprobs is None


def test_greedy_fast_path_equals_general_path() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2),
        SamplingParams(temperature=1e-6),
    ]
    outputs = [[1, 2, 2], [int(logits[1].argmax()), 5], [int(logits[2].argmax())] * 3, [7], []]
    prompts = [[3], [int(logits[1].argmax())], [0, 1], [], [9]]
    md = build(params, prompts=prompts, outputs=outputs)
    assert md.all_greedy
    fast = sampler(logits, md).sampled_token_ids
    slow_md = dataclasses.replace(
        md, all_greedy=False, all_random=False, no_penalties=False, no_top_k_top_p_min_p=False
    )
    slow = sampler(logits, slow_md).sampled_token_ids
    assert torch.equal(fast, slow)

    # The same greedy rows inside a mixed batch give the same tokens.
    mixed = build(
        params + [SamplingParams(temperature=1.0, top_k=2)],
        prompts=prompts + [[]],
        outputs=outputs + [[]],
    )
    assert not mixed.all_greedy and not mixed.all_random
    mixed_out = sampler(torch.cat([logits, logits[:1]]), mixed).sampled_token_ids
    assert torch.equal(mixed_out[:5], fast)


def test_bf16_logits_are_upcast() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    md = build([SamplingParams(temperature=0.0, logprobs=2)] * 3)
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=1))
    assert out.logprobs is not None and out.logprobs.topk_logprobs.dtype == torch.float32


def test_sampler_does_not_modify_logits() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    md = build(
        [SamplingParams(top_p=0.8, repetition_penalty=1.3), SamplingParams(temperature=0), SamplingParams()],
        outputs=[[1, 2], [3], [4]],
        banned=[[0], [1], []],
    )
    sampler(logits, md)
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    samples = draw(SamplingParams(temperature=temperature))
    assert_distribution(samples, softmax64(LOGITS / temperature))


def test_seeded_rows_distribution() -> None:
    """The per-row generator path is also distributed as softmax (5000 differently seeded rows)."""
    n = 5000
    md = build([SamplingParams(temperature=0.8)] * n, generators=[make_generator(s) for s in range(n)])
    samples = sampler(LOGITS.expand(n, -1).contiguous(), md).sampled_token_ids
    assert_distribution(samples, softmax64(LOGITS / 0.8))


@pytest.mark.parametrize(("k", "temperature"), [(1, 1.0), (5, 1.0), (8, 0.7)])
def test_top_k(k: int, temperature: float) -> None:
    samples = draw(SamplingParams(temperature=temperature, top_k=k))
    top = torch.topk(LOGITS, k).indices
    keep = torch.zeros(V, dtype=torch.bool)
    keep[top] = True
    assert set(samples.unique().tolist()) <= set(top.tolist())
    assert_distribution(samples, renormalised(softmax64(LOGITS / temperature), keep))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest most-likely set with cumulative probability >= top_p (independent reference)."""
    order = sorted(range(probs.numel()), key=lambda i: -float(probs[i]))
    keep = torch.zeros(probs.numel(), dtype=torch.bool)
    total = 0.0
    for i in order:
        keep[i] = True
        total += float(probs[i])
        # The chosen top_p values sit far from every cumulative boundary.
        assert abs(total - top_p) > 1e-3
        if total >= top_p:
            break
    return keep


@pytest.mark.parametrize(("top_p", "temperature"), [(0.5, 1.0), (0.8, 1.0), (0.9, 0.6), (0.01, 1.0)])
def test_top_p(top_p: float, temperature: float) -> None:
    probs = softmax64(LOGITS / temperature)
    keep = nucleus(probs, top_p)
    samples = draw(SamplingParams(temperature=temperature, top_p=top_p))
    assert set(samples.unique().tolist()) == set(torch.nonzero(keep).squeeze(1).tolist())
    assert_distribution(samples, renormalised(probs, keep))


def test_top_k_then_top_p() -> None:
    k, top_p = 6, 0.7
    probs = softmax64(LOGITS)
    in_k = torch.zeros(V, dtype=torch.bool)
    in_k[torch.topk(LOGITS, k).indices] = True
    after_k = renormalised(probs, in_k)  # top-k first, then the nucleus of the renormalised probs
    keep = nucleus(after_k, top_p)
    samples = draw(SamplingParams(top_k=k, top_p=top_p))
    assert set(samples.unique().tolist()) == set(torch.nonzero(keep).squeeze(1).tolist())
    assert_distribution(samples, renormalised(probs, keep))


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p(min_p: float) -> None:
    probs = softmax64(LOGITS)
    keep = probs >= min_p * probs.max()
    samples = draw(SamplingParams(min_p=min_p))
    assert set(samples.unique().tolist()) == set(torch.nonzero(keep).squeeze(1).tolist())
    assert_distribution(samples, renormalised(probs, keep))


def test_mixed_batch_routes_parameters_per_row() -> None:
    """Four configurations interleaved row by row in one batch each follow their own distribution."""
    configs = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(top_p=0.8),
        SamplingParams(temperature=1.5, min_p=0.2),
    ]
    per_config = 5000
    params = configs * per_config
    torch.manual_seed(7)
    out = sampler(LOGITS.expand(len(params), -1).contiguous(), build(params)).sampled_token_ids
    rows = out.view(per_config, len(configs))

    assert torch.all(rows[:, 0] == LOGITS.argmax())
    in_4 = torch.zeros(V, dtype=torch.bool)
    in_4[torch.topk(LOGITS, 4).indices] = True
    assert_distribution(rows[:, 1], renormalised(softmax64(LOGITS / 0.5), in_4))
    p = softmax64(LOGITS)
    assert_distribution(rows[:, 2], renormalised(p, nucleus(p, 0.8)))
    p15 = softmax64(LOGITS / 1.5)
    assert_distribution(rows[:, 3], renormalised(p15, p15 >= 0.2 * p15.max()))


def test_mixed_batch_top_k_only_path() -> None:
    """Without top-p the topk (no-sort) path runs; rows with top_k disabled must stay untruncated."""
    configs = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_k=30)]  # 30 > V: clamped
    per_config = 8000
    params = configs * per_config
    md = build(params)
    assert md.no_top_p and not md.no_top_k
    torch.manual_seed(8)
    out = sampler(LOGITS.expand(len(params), -1).contiguous(), md).sampled_token_ids
    rows = out.view(per_config, len(configs))
    in_3 = torch.zeros(V, dtype=torch.bool)
    in_3[torch.topk(LOGITS, 3).indices] = True
    assert_distribution(rows[:, 0], renormalised(softmax64(LOGITS), in_3))
    assert_distribution(rows[:, 1], softmax64(LOGITS))
    assert_distribution(rows[:, 2], softmax64(LOGITS))


# --------------------------------------------------------------------------- penalties


def reference_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    presence: float,
    frequency: float,
) -> list[float]:
    """Direct transcription of the published formulas, one token at a time.

    Repetition (CTRL; HF RepetitionPenaltyLogitsProcessor): tokens in prompt or output get
    ``logit / r`` if ``logit > 0`` else ``logit * r``.  Then OpenAI:
    ``mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence`` over output tokens.
    """
    result = list(logits)
    for j in set(prompt) | set(output):
        result[j] = result[j] / repetition if result[j] > 0 else result[j] * repetition
    for j in set(output):
        c = output.count(j)
        result[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return result


def penalise(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    out = apply_penalties(
        torch.tensor([logits]),
        [prompt],
        [output],
        torch.tensor([rep]),
        torch.tensor([pres]),
        torch.tensor([freq]),
    )
    return out[0].tolist()


def test_repetition_penalty_hand_computed() -> None:
    logits = [2.0, -2.0, 1.0, 0.5, 0.0, 3.0]
    # Token 0 is in the prompt, 1 and 3 in the output, 4 (logit 0) in the output; 2 and 5 unseen.
    got = penalise(logits, prompt=[0], output=[1, 1, 3, 4], rep=2.0, pres=0.0, freq=0.0)
    assert got == pytest.approx([1.0, -4.0, 1.0, 0.25, 0.0, 3.0])


def test_frequency_presence_hand_computed() -> None:
    logits = [2.0, -2.0, 1.0, 0.5, 0.0, 3.0]
    got = penalise(logits, prompt=[0], output=[1, 1, 3], rep=1.0, pres=0.3, freq=0.5)
    # Prompt-only token 0 is untouched; token 1: -2 - 2*0.5 - 0.3; token 3: 0.5 - 0.5 - 0.3.
    assert got == pytest.approx([2.0, -3.3, 1.0, -0.3, 0.0, 3.0])
    # Negative penalties encourage repetition.
    got = penalise(logits, prompt=[], output=[5, 5], rep=1.0, pres=-1.0, freq=-0.25)
    assert got == pytest.approx([2.0, -2.0, 1.0, 0.5, 0.0, 4.5])


def test_all_penalties_combined_hand_computed() -> None:
    logits = [2.0, -2.0, 1.0, 0.5, 0.0, 3.0]
    got = penalise(logits, prompt=[0], output=[1, 1, 3], rep=2.0, pres=0.3, freq=0.5)
    assert got == pytest.approx([1.0, -5.3, 1.0, -0.55, 0.0, 3.0])


def test_penalties_match_reference_on_random_batches() -> None:
    g = torch.Generator().manual_seed(11)
    b, v = 7, 30
    logits = torch.randn(b, v, generator=g) * 3
    prompts = [torch.randint(0, v, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(b)]
    outputs = [torch.randint(0, v, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(b)]
    rep = (torch.rand(b, generator=g) * 2 + 0.5).tolist()
    pres = (torch.rand(b, generator=g) * 4 - 2).tolist()
    freq = (torch.rand(b, generator=g) * 4 - 2).tolist()
    rep[0], pres[0], freq[0] = 1.0, 0.0, 0.0  # a neutral row in a penalised batch

    got = apply_penalties(
        logits.clone(), prompts, outputs, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq)
    )
    for i in range(b):
        want = reference_penalties(logits[i].tolist(), prompts[i], outputs[i], rep[i], pres[i], freq[i])
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), f"row {i}"
    assert torch.equal(got[0], logits[0])  # neutral row: bit-for-bit unchanged


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),   # 3.0 -> 1.5 < 2.5
        SamplingParams(temperature=0.0, frequency_penalty=0.3),    # 3.0 - 0.6 = 2.4 < 2.5
    ]
    md = build(params, prompts=[[1]] * 3, outputs=[[1, 1]] * 3)
    assert sampler(logits, md).sampled_token_ids.tolist() == [1, 2, 2]


def test_frequency_penalty_shifts_sampled_distribution() -> None:
    """Random rows sample from softmax(penalised logits / T)."""
    n = N_SAMPLES
    output = [5, 5, 13, 0]
    params = SamplingParams(temperature=0.9, frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.3)
    torch.manual_seed(5)
    md = build([params] * n, prompts=[[8, 20]] * n, outputs=[output] * n)
    samples = sampler(LOGITS.expand(n, -1).contiguous(), md).sampled_token_ids
    want = reference_penalties(LOGITS.tolist(), [8, 20], output, 1.3, 0.2, 0.7)
    assert_distribution(samples, softmax64(torch.tensor(want, dtype=torch.float64) / 0.9))


# --------------------------------------------------------------------------- seeds


STEPS = 6


def run_steps(
    batch: list[SamplingParams],
    seeds: list[int | None],
    logits_for_row: list[list[torch.Tensor]],
) -> list[list[int]]:
    """Run ``STEPS`` sampler steps, feeding each row's tokens back as its output history."""
    gens: list[torch.Generator | None] = [None if s is None else make_generator(s) for s in seeds]
    outputs: list[list[int]] = [[] for _ in batch]
    for step in range(STEPS):
        logits = torch.stack([row[step] for row in logits_for_row])
        md = build(batch, prompts=[[1, 2, 3]] * len(batch), outputs=outputs, generators=gens)
        tokens = sampler(logits, md).sampled_token_ids.tolist()
        for out, t in zip(outputs, tokens):
            out.append(t)
    return outputs


def step_logits(seed: int, vocab: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(vocab, generator=g) * 0.5 for _ in range(STEPS)]  # flat-ish: randomness matters


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.9, seed=1234),
        SamplingParams(temperature=1.2, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2, seed=99),
    ],
)
def test_seed_reproducible_alone_or_in_any_batch(target: SamplingParams) -> None:
    mine = step_logits(0)
    alone = run_steps([target], [target.seed], [mine])[0]

    others = [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, seed=8),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=1.3, frequency_penalty=0.5, seed=9),
        SamplingParams(min_p=0.1),
    ]
    for position in (0, 3, 7):
        batch = others[:position] + [target] + others[position:]
        seeds = [p.seed for p in batch]
        logits = [step_logits(100 + i) for i in range(len(batch))]
        logits[position] = mine
        torch.manual_seed(position)  # the unseeded rows' draws differ from run to run
        got = run_steps(batch, seeds, logits)[position]
        assert got == alone, f"position {position}: {got} != {alone}"

    # A different seed gives a different sequence.
    other_seed = dataclasses.replace(target, seed=(target.seed or 0) + 1)
    assert run_steps([other_seed], [other_seed.seed], [mine])[0] != alone


def test_seeded_rows_do_not_touch_default_generator() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    md = build([SamplingParams(seed=1)] * 2, generators=[make_generator(1), make_generator(2)])
    sampler(LOGITS.expand(2, -1).contiguous(), md)
    assert torch.equal(torch.rand(4), expected)


# --------------------------------------------------------------------------- banned ids


def test_banned_token_ids_respected() -> None:
    top2 = torch.topk(LOGITS, 2).indices.tolist()
    # Greedy: the argmax is banned, so the runner-up wins.
    md = build([SamplingParams(temperature=0.0)], banned=[[top2[0]]])
    assert sampler(LOGITS.unsqueeze(0), md).sampled_token_ids.tolist() == [top2[1]]

    # Random: banned ids never appear, and the rest follow the renormalised softmax.
    n = N_SAMPLES
    banned = top2 + [0]
    torch.manual_seed(9)
    params = [SamplingParams(temperature=1.0)] * n
    md = build(params, banned=[banned] * n)
    samples = sampler(LOGITS.expand(n, -1).contiguous(), md).sampled_token_ids
    keep = torch.ones(V, dtype=torch.bool)
    keep[banned] = False
    assert_distribution(samples, renormalised(softmax64(LOGITS), keep))


def test_banned_only_applies_to_its_row() -> None:
    md = build([SamplingParams(temperature=0.0)] * 2, banned=[[int(LOGITS.argmax())], []])
    out = sampler(LOGITS.expand(2, -1).contiguous(), md).sampled_token_ids.tolist()
    assert out[0] != int(LOGITS.argmax()) and out[1] == int(LOGITS.argmax())


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_distribution() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 40, generator=g) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, top_p=0.5),  # no logprobs requested: still computed to max width
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=0),
        SamplingParams(temperature=1.3, min_p=0.1, logprobs=1, seed=3),
    ]
    outputs = [[0], [int(logits[1].argmax())] * 2, [], [int(logits[3].argmax())] * 3, [1]]
    md = build(params, outputs=outputs, generators=[None, None, None, None, make_generator(3)],
               banned=[[], [2], [], [], []])
    assert md.max_num_logprobs == 5
    out = sampler(logits, md)
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, dim=1)
    ids = out.sampled_token_ids
    assert lp.sampled_logprob.shape == (5,) and lp.sampled_logprob.dtype == torch.float32
    assert torch.allclose(lp.sampled_logprob, raw[torch.arange(5), ids])
    want = torch.topk(raw, 5, dim=1)
    assert lp.topk_ids.shape == (5, 5) and lp.topk_ids.dtype == torch.int64
    assert torch.equal(lp.topk_ids, want.indices)
    assert torch.allclose(lp.topk_logprobs, want.values)
    for i in range(5):
        ordered = sorted(raw[i].tolist(), reverse=True)
        assert int(lp.sampled_rank[i]) == ordered.index(raw[i, ids[i]].item()) + 1
    assert lp.sampled_rank.dtype == torch.int64
    # The penalised greedy row did not pick the raw argmax, so its rank is > 1.
    assert int(ids[3]) != int(logits[3].argmax()) and int(lp.sampled_rank[3]) > 1
    assert int(lp.sampled_rank[0]) == 1


def test_zero_logprobs_gives_empty_topk() -> None:
    md = build([SamplingParams(temperature=0.0, logprobs=0)] * 2)
    out = sampler(LOGITS.expand(2, -1).contiguous(), md)
    assert out.logprobs is not None
    assert out.logprobs.topk_ids.shape == (2, 0)
    assert torch.allclose(out.logprobs.sampled_logprob, torch.log_softmax(LOGITS, 0).max().expand(2))


# --------------------------------------------------------------------------- metadata


def test_metadata_build_flags_and_tensors() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.9, logprobs=2),
        SamplingParams(presence_penalty=0.1, logprobs=4),
    ]
    md = build(params)
    assert md.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert md.temperature.dtype == torch.float32 and md.top_k.dtype == torch.int64
    assert md.top_k.tolist() == [3, 0, 0]
    assert md.max_num_logprobs == 4
    assert not md.all_greedy and not md.all_random and not md.no_penalties
    assert not md.no_top_k_top_p_min_p and md.no_top_k and not md.no_top_p and md.no_min_p
    assert md.banned_token_ids == [[], [], []]

    plain = build([SamplingParams()] * 2)
    assert plain.all_random and plain.no_penalties and plain.no_top_k_top_p_min_p
    assert plain.max_num_logprobs is None
    with pytest.raises(ValueError):
        SamplingMetadata.build([SamplingParams()], [[]], [[], []], [None])


@pytest.mark.parametrize("scale", [0.5, 2.0, 8.0])
@pytest.mark.parametrize("quantum", [None, 0.5])
def test_top_p_candidates_equal_full_sort(scale: float, quantum: float | None) -> None:
    """The topk-candidate nucleus keeps exactly the tokens the full stable sort keeps.

    Flat rows (scale 0.5: nucleus wider than the candidates, the sort fallback), peaked rows
    (candidate path) and rounded logits (ties across the candidate boundary), with top-k mixed in.
    """
    from tinyvllm.sample.sampler import TOP_P_CANDIDATES, _top_p_by_sort, apply_top_k_only, apply_top_k_top_p
    g = torch.Generator().manual_seed(int(scale * 10) + (quantum is not None))
    x = torch.randn(12, 3 * TOP_P_CANDIDATES, generator=g) * scale
    if quantum is not None:
        x = (x / quantum).round() * quantum
    top_p = torch.rand(12, generator=g).clamp(0.05, 1.0)
    top_p[::4] = 1.0
    for top_k in (None, torch.randint(0, 2 * TOP_P_CANDIDATES, (12,), generator=g)):
        got = apply_top_k_top_p(x, top_k, top_p)
        base = x if top_k is None else apply_top_k_only(x, top_k)
        want = _top_p_by_sort(base, top_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        assert torch.equal(got[torch.isfinite(got)], base[torch.isfinite(got)])
