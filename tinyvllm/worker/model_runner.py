"""Model runner: turns a data-only :class:`SchedulerOutput` into packed input tensors, runs the model, samples.

The runner keeps its own state per request (:class:`CachedRequestState`, as vLLM
v1's ``GPUModelRunner.requests``): the token history (prompt + every token it
sampled), the block table, and the sampling state (a seeded request's
``torch.Generator``, the tokens penalties count). The scheduler sends a request
whole once, then only what changes (see :mod:`tinyvllm.scheduler_output`).
State survives a preemption (the generator keeps its stream) and is dropped when
the scheduler reports the request finished.

Inputs built per step (all sequences' new tokens flattened, no padding):
``input_ids`` [T] int64, ``positions`` [T] int64, ``slot_mapping`` [T] int64,
``block_tables`` [S, max_blocks] int64, ``seq_lens`` [S] and ``query_start_loc``
[S+1]. Logits are computed only for requests whose step reaches the end of their
known tokens (a finished prefill or a decode); mid-prompt chunks sample nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tinyvllm import envs
from tinyvllm.attention.kv_quant import canonical_kv_cache_dtype, kv_storage
from tinyvllm.attention.selector import get_attn_backend
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.outputs import ModelRunnerOutput, TokenLogprobs
from tinyvllm.sample.sampler import Sampler, SamplingMetadata, apply_token_bitmask, compute_logprobs, make_generator
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.spec_decode.rejection_sampler import rejection_sample
from tinyvllm.worker.cuda_graph import DecodeGraphRunner

logger = logging.getLogger("tinyvllm")


@dataclass
class CachedRequestState:
    """What the runner keeps of one request between steps.

    Attributes:
        token_ids: prompt followed by every token sampled so far.
        prompt_token_ids / output_token_ids: the two parts of ``token_ids`` (kept apart so that the
            sampler's penalties read them without a copy per step).
        block_ids: the request's block table (physical block ids, logical order).
        num_computed_tokens: tokens with KV, as of the last schedule.
        generator: a seeded request's own generator (on the runner's device), else None.
    """

    req_id: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    # prompt_logprobs requests: logprobs of prompt tokens 1..num_prompt_lps computed so far (kept across
    # chunks and preemptions: a recomputed prefix is not scored twice) and whether they have been sent.
    prompt_lps: list[TokenLogprobs] = field(default_factory=list)
    prompt_lps_sent: bool = False

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The canonical ``--kv-cache-dtype`` (``auto`` -> the model dtype's name) for a model of ``dtype``.
    Every attention backend (cpu, torch, triton) runs every KV dtype.

    Raises:
        ValueError: an unknown value, or ``bfloat16`` for a model of another dtype (one line, naming the flag).
    """
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    if kind == "auto":
        return "bfloat16" if dtype == torch.bfloat16 else "auto"
    if kind == "bfloat16" and dtype != torch.bfloat16:
        raise ValueError(f"kv_cache_dtype bfloat16 needs dtype bfloat16 (the model runs in {dtype}; use auto)")
    return kind


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors (on ``device``) and per-request sampling state.

    On CUDA, unless ``enforce_eager``, decode-only steps replay CUDA graphs
    (:class:`~tinyvllm.worker.cuda_graph.DecodeGraphRunner`, captured here for batch
    sizes up to ``max_num_seqs``); other steps run eagerly.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 enforce_eager: bool = True, kv_cache_dtype: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        if self.device.type == "cuda":  # kernels launch and graphs capture on the current device's streams
            if self.device.index is None:  # torch.cuda.set_device rejects a bare torch.device("cuda")
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = dtype
        self.attn_backend = get_attn_backend(self.device, dtype)  # chosen once; the model runs its ops
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, dtype)
        t0, packed = time.monotonic(), getattr(model, "packed", False)
        model.bind_attn_backend(self.attn_backend)
        if getattr(model, "packed", False) and not packed:
            logger.info("packed the linear weights for the %s backend's GEMM in %.1fs", self.attn_backend.name,
                        time.monotonic() - t0)
        # One [2, num_blocks, block_size, Hk, D] tensor per layer ([..., D + 2] one-byte elements for an
        # int8/fp8 cache: tinyvllm.attention.kv_quant). On the CPU torch.empty leaves pages
        # untouched, so resident memory grows only as blocks are written; on a GPU zeros are free.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        kv_elem, kv_extra = kv_storage(self.kv_cache_dtype, dtype)
        self.kv_caches = [
            alloc(2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim + kv_extra, dtype=kv_elem,
                  device=self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.graph_runner: DecodeGraphRunner | None = None
        self.kv_offload = None  # a worker.kv_offload tier (HostKVTier / DiskKVTier) when one is configured
        # The C++ CPU kernels whose parallel pool _run_model switches per step (None: no such kernels).
        self._pool_kern = getattr(self.attn_backend, "kernels", None)
        self._pool_mode = self._cpu_pool_mode()
        if self.device.type == "cuda" and not enforce_eager:
            runner = DecodeGraphRunner(model, self.kv_caches, block_size, max_num_seqs,
                                       max_model_len or cfg.max_position_embeddings, self.device)
            if runner.capture():
                self.graph_runner = runner

    @staticmethod
    def _cpu_pool_mode() -> str:
        """``TINYVLLM_CPU_POOL``, which :meth:`_run_model` applies in every step where the C++ CPU
        kernels run:

        - ``auto`` (the default): a step's parallel loops run on ``cpu_pool.h``'s pool when the step has
          exactly one token (batch-1 decode), on ``at::parallel_for`` otherwise. At batch 1 a step is
          ~200 short parallel regions, and the API process's per-token work (or any other process)
          takes one of the two cores for part of each step; the pool's caller does not wait for a
          worker that lost its core (c=1 TPOT over HTTP: docs/benchmarks.md, "The pool in batch-1
          steps only"). In larger steps its run-alone rule gave up the second thread too often (c16
          and the agent workload 27-37 % slower), so they keep ``at::parallel_for``.
        - ``1``: the pool in every step; ``0``: never.

        The switch is process-wide, so it is set in every step (another runner in the process may
        have changed it). The pool divides work, never arithmetic: outputs do not depend on it
        (tests/test_cpu_kernels.py, tests/test_engine.py).

        Raises:
            ValueError: ``TINYVLLM_CPU_POOL`` is not ``auto``, ``0`` or ``1``.
        """
        mode = envs.TINYVLLM_CPU_POOL
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"TINYVLLM_CPU_POOL must be auto, 0 or 1, not {mode!r}")
        return mode

    # ------------------------------------------------------------------ per-request state
    def _update_states(self, sched: SchedulerOutput) -> None:
        """Apply the schedule's changes to the per-request state: drop finished requests, add new ones,
        extend (or, after a preemption, replace) block tables, take ``num_computed_tokens``."""
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            sp = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids), prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=[],
                sampling_params=sp, eos_token_ids=frozenset(new.eos_token_ids), block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=make_generator(sp.seed, self.device) if sp.seed is not None else None)
        c = sched.scheduled_cached_reqs
        for rid, resumed, new_blocks, computed in zip(c.req_ids, c.resumed_from_preemption, c.new_block_ids,
                                                      c.num_computed_tokens):
            st = self.requests[rid]
            if resumed:
                st.block_ids = list(new_blocks)
            else:
                st.block_ids.extend(new_blocks)
            st.num_computed_tokens = computed

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward over all scheduled tokens, then sample where a token is due.

        Raises:
            KeyError: the schedule names a request the runner was never sent.
        """
        if self.kv_offload is not None and (sched.kv_offload_stores or sched.kv_offload_loads):
            # Before the forward: stores first (their blocks are overwritten by this step), then loads.
            self.kv_offload.store(self.kv_caches, sched.kv_offload_stores)
            self.kv_offload.load(self.kv_caches, sched.kv_offload_loads)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []  # index into the packed tokens of each sampled row
        sample_reqs: list[CachedRequestState] = []
        plp_rows: list[int] = []  # prompt_logprobs: packed rows whose logits score the next prompt token
        plp_reqs: list[tuple[CachedRequestState, int]] = []  # (request, number of its rows in plp_rows)
        spec = sched.scheduled_spec_decode_tokens
        sample_drafts: list[list[int]] = []  # per sampled request: its drafts (speculative decoding)
        for rid, num_new in sched.num_scheduled_tokens.items():
            st = self.requests[rid]
            start = st.num_computed_tokens
            drafts = spec.get(rid, []) if spec else []
            end = start + num_new - len(drafts)  # the known tokens' end; the drafts follow them
            if st.sampling_params.prompt_logprobs is not None and not st.prompt_lps_sent:
                # position p scores prompt token p + 1; positions already scored (before a preemption) are skipped
                lo, hi = max(start, len(st.prompt_lps)), min(end, len(st.prompt_token_ids) - 1)
                if hi > lo:
                    plp_rows.extend(range(len(input_ids) + lo - start, len(input_ids) + hi - start))
                    plp_reqs.append((st, hi - lo))
            input_ids.extend(st.token_ids[start:end])
            input_ids.extend(drafts)
            positions.extend(range(start, start + num_new))
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            tables.append(st.block_ids)
            if end == len(st.token_ids):  # the step reaches the end of the known tokens: sample
                # (a request with k drafts samples k + 1 rows: its last known token's and each draft's)
                sample_rows.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
                sample_reqs.append(st)
                sample_drafts.append(drafts)
        hidden = self._run_model(input_ids, positions, query_lens, seq_lens, tables)
        if plp_reqs:
            self._score_prompt(hidden[torch.tensor(plp_rows, device=self.device)], plp_reqs)
        if not sample_reqs:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        constrained: set[str] = set()
        if sched.structured_output_request_ids:
            logits, constrained = self._apply_grammar_bitmask(logits, sched, sample_reqs, sample_drafts)
        if spec:
            out = self._sample_spec(logits, sample_reqs, sample_drafts, constrained)
        else:
            out = self._sample(logits, sample_reqs, constrained)
        for st in sample_reqs:  # the runner's own copy of the token history
            for t in out.spec_accepted.get(st.req_id, ()):
                st.append(t)
            st.append(out.sampled[st.req_id])
            if st.sampling_params.prompt_logprobs is not None and not st.prompt_lps_sent:
                out.prompt_logprobs[st.req_id] = st.prompt_lps
                st.prompt_lps, st.prompt_lps_sent = [], True
        return out

    def _score_prompt(self, hidden: torch.Tensor, reqs: list[tuple[CachedRequestState, int]]) -> None:
        """Prompt logprobs: ``hidden`` [R, hidden] holds, request after request, the rows of positions
        ``len(st.prompt_lps) ..`` whose raw log-softmax scores the next prompt token (vLLM's prompt_logprobs:
        the logprob and rank of the actual token, plus the top ``prompt_logprobs``)."""
        logprobs = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)  # [R, V]
        targets: list[int] = []
        for st, n in reqs:
            first = len(st.prompt_lps) + 1
            targets.extend(st.prompt_token_ids[first:first + n])
        k = max(st.sampling_params.prompt_logprobs for st, _ in reqs)
        lp = compute_logprobs(logprobs, torch.tensor(targets, device=logprobs.device), k)
        slp, rank = lp.sampled_logprob.tolist(), lp.sampled_rank.tolist()
        tids, tlps = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
        row = 0
        for st, n in reqs:
            top_n = st.sampling_params.prompt_logprobs
            for _ in range(n):
                st.prompt_lps.append(TokenLogprobs(targets[row], slp[row], rank[row],
                                                   list(zip(tids[row][:top_n], tlps[row][:top_n]))))
                row += 1

    def _run_model(self, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
                   tables: list[list[int]]) -> torch.Tensor:
        """The forward over the packed batch: [T, hidden] final hidden states (a decode-only step replays
        a CUDA graph when one fits, else the backend's metadata is built and the model runs eagerly)."""
        gr = self.graph_runner
        if (gr is not None and all(q == 1 for q in query_lens)  # decode-only: one new token per sequence
                and gr.can_run(len(tables), max(len(t) for t in tables))):
            return gr.run(input_ids, positions, seq_lens, tables)
        if self._pool_kern is not None:
            mode = self._pool_mode
            self._pool_kern.set_parallel_pool(mode == "1" or (mode == "auto" and len(input_ids) == 1))
        md = self.attn_backend.build_metadata(query_lens, seq_lens, tables, self.block_size)
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model(ids_t, pos_t, self.kv_caches, md)

    def _apply_grammar_bitmask(self, logits: torch.Tensor, sched: SchedulerOutput,
                               reqs: list[CachedRequestState], drafts: list[list[int]] | None = None
                               ) -> tuple[torch.Tensor, set[str]]:
        """Mask the constrained rows' logits with the schedule's grammar bitmask (before penalties,
        temperature, top-k/p and sampling, so logprobs are those of the masked distribution). A request
        with k drafts has k + 1 consecutive logits rows and is named k + 1 times in the bitmask's ids."""
        ids = sched.structured_output_request_ids
        row_of, r = {}, 0
        for i, st in enumerate(reqs):
            row_of[st.req_id] = r
            r += 1 + (len(drafts[i]) if drafts else 0)
        seen: dict[str, int] = {}
        row_list = []
        for rid in ids:
            j = seen.get(rid, 0)
            seen[rid] = j + 1
            row_list.append(row_of[rid] + j)
        words = len(sched.grammar_bitmask) // 4 // len(ids)
        bitmask = torch.frombuffer(bytearray(sched.grammar_bitmask), dtype=torch.int32).view(len(ids), words)
        rows = torch.tensor(row_list, dtype=torch.int64, device=logits.device)
        if logits.dtype != torch.float32:
            logits = logits.float()
        return apply_token_bitmask(logits, bitmask, rows), set(ids)

    def _sampling_rows(self, logits: torch.Tensor, reqs: list[CachedRequestState], drafts: list[list[int]] | None,
                       constrained: set[str]) -> tuple[SamplingMetadata, torch.Tensor]:
        """The per-row sampling setup of a step: ``len(drafts[i]) + 1`` consecutive rows of ``logits``
        [R, vocab] per request (one without drafts). Row j of a request is sampled as if its drafts
        ``x_1..x_j`` were already output tokens: penalties count them, EOS and stop ids are banned while
        the output is shorter than ``min_tokens`` (unless a grammar decides, ``constrained``), and the
        request's OpenAI ``logit_bias`` is added to the row. Returns the metadata and the logits (a
        biased copy where any row has a bias; the input is not modified)."""
        params, prompts, outputs, gens, banned, bias_rows = [], [], [], [], [], []
        for i, st in enumerate(reqs):
            sp = st.sampling_params
            d = drafts[i] if drafts else []
            # EOS and stop ids banned below min_tokens: built only for requests still short of it
            min_left = 0 if st.req_id in constrained else sp.min_tokens - len(st.output_token_ids)
            stop_ids = sorted(st.eos_token_ids | set(sp.stop_token_ids or [])) if min_left > 0 else []
            for j in range(len(d) + 1):
                if sp.logit_bias:
                    bias_rows.append((len(params), sp.logit_bias))
                params.append(sp)
                prompts.append(st.prompt_token_ids)
                outputs.append(st.output_token_ids + d[:j] if j else st.output_token_ids)
                gens.append(st.generator)
                banned.append(stop_ids if j < min_left else [])
        smd = SamplingMetadata.build(params, prompts, outputs, gens, banned, device=self.device)
        if bias_rows:  # OpenAI logit_bias: added to the logits before the sampler (penalties, top-k/p, sampling)
            rows = [i for i, b in bias_rows for _ in b]
            cols = [t for _, b in bias_rows for t in b]
            vals = [v for _, b in bias_rows for v in b.values()]
            logits = logits.clone()
            logits.index_put_((torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)),
                              torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
        return smd, logits

    def _sample(self, logits: torch.Tensor, reqs: list[CachedRequestState],
                constrained: set[str] = frozenset()) -> ModelRunnerOutput:  # type: ignore[assignment]
        """Sample one token per row of ``logits`` [N, vocab] float32 (row i is ``reqs[i]``)."""
        smd, logits = self._sampling_rows(logits, reqs, None, constrained)
        out = self.sampler(logits, smd)
        token_ids = out.sampled_token_ids.tolist()
        sampled = {st.req_id: t for st, t in zip(reqs, token_ids)}
        lps: dict[str, TokenLogprobs] = {}
        if out.logprobs is not None:
            lp = out.logprobs
            slp, rank = lp.sampled_logprob.tolist(), lp.sampled_rank.tolist()
            tids, tlps = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
            for i, st in enumerate(reqs):
                n = st.sampling_params.logprobs
                if n is None:
                    continue
                lps[st.req_id] = TokenLogprobs(token_ids[i], slp[i], rank[i], list(zip(tids[i][:n], tlps[i][:n])))
        return ModelRunnerOutput(sampled, lps)

    def _sample_spec(self, logits: torch.Tensor, reqs: list[CachedRequestState], drafts: list[list[int]],
                     constrained: set[str] = frozenset()) -> ModelRunnerOutput:  # type: ignore[assignment]
        """A step with drafts: verify them (:func:`~tinyvllm.spec_decode.rejection_sampler.rejection_sample`).

        ``logits`` [R, vocab] float32 holds ``len(drafts[i]) + 1`` consecutive rows per request; row j
        of a request is sampled as if its drafts ``x_1..x_j`` were already output tokens (penalties,
        ``min_tokens``, logit_bias as in :meth:`_sample`). Logprobs are of the emitted tokens, under
        the raw distribution of the row each came from.
        """
        if logits.dtype != torch.float32:
            logits = logits.float()
        smd, logits = self._sampling_rows(logits, reqs, drafts, constrained)
        tokens, token_rows = rejection_sample(self.sampler, logits, smd, drafts)
        out = ModelRunnerOutput()
        for st, d, toks in zip(reqs, drafts, tokens):
            out.sampled[st.req_id] = toks[-1]
            if d:
                out.spec_accepted[st.req_id] = toks[:-1]
        if smd.max_num_logprobs is not None:
            want = [i for i, st in enumerate(reqs) if st.sampling_params.logprobs is not None]
            flat_rows = [r for i in want for r in token_rows[i]]
            flat_toks = [t for i in want for t in tokens[i]]
            raw = torch.log_softmax(logits[torch.tensor(flat_rows, device=logits.device)], dim=1)
            lp = compute_logprobs(raw, torch.tensor(flat_toks, device=logits.device), smd.max_num_logprobs)
            slp, rank = lp.sampled_logprob.tolist(), lp.sampled_rank.tolist()
            tids, tlps = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
            x = 0
            for i in want:
                st, n = reqs[i], reqs[i].sampling_params.logprobs
                entries = []
                for t in tokens[i]:
                    entries.append(TokenLogprobs(t, slp[x], rank[x], list(zip(tids[x][:n], tlps[x][:n]))))
                    x += 1
                out.logprobs[st.req_id] = entries[-1]
                if drafts[i]:
                    out.spec_logprobs[st.req_id] = entries[:-1]
        return out
