"""Model runner: turns a :class:`SchedulerOutput` into packed input tensors, runs the model, samples.

Inputs built per step (all sequences' new tokens flattened, no padding):
``input_ids`` [T] int64, ``positions`` [T] int64, ``slot_mapping`` [T] int64,
``block_tables`` [S, max_blocks] int64, ``seq_lens`` [S] and ``query_start_loc``
[S+1]. Logits are computed only for requests whose step reaches the end of their
known tokens (a finished prefill or a decode); mid-prompt chunks sample nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.attention.selector import get_attn_backend
from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.sample.sampler import Sampler, SamplingMetadata, make_generator
from tinyvllm.worker.cuda_graph import DecodeGraphRunner


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled token (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]                 # request id -> token id
    logprobs: dict[str, TokenLogprobs]      # request id -> logprobs, when requested


class ModelRunner:
    """Owns the model weights and the paged KV cache tensors (on ``device``).

    On CUDA, unless ``enforce_eager``, decode-only steps replay CUDA graphs
    (:class:`~tinyvllm.worker.cuda_graph.DecodeGraphRunner`, captured here for batch
    sizes up to ``max_num_seqs``); other steps run eagerly.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 enforce_eager: bool = True) -> None:
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
        model.bind_attn_backend(self.attn_backend)
        # One [2, num_blocks, block_size, Hk, D] tensor per layer. On the CPU torch.empty leaves pages
        # untouched, so resident memory grows only as blocks are written; on a GPU zeros are free.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        self.kv_caches = [
            alloc(2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self.graph_runner: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and not enforce_eager:
            runner = DecodeGraphRunner(model, self.kv_caches, block_size, max_num_seqs,
                                       max_model_len or cfg.max_position_embeddings, self.device)
            if runner.capture():
                self.graph_runner = runner

    def _run_model(self, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
                   tables: list[list[int]]) -> torch.Tensor:
        """The forward over the packed batch: [T, hidden] final hidden states (a decode-only step replays
        a CUDA graph when one fits, else the backend's metadata is built and the model runs eagerly)."""
        gr = self.graph_runner
        if (gr is not None and all(q == 1 for q in query_lens)  # decode-only: one new token per sequence
                and gr.can_run(len(tables), max(len(t) for t in tables))):
            return gr.run(input_ids, positions, seq_lens, tables)
        md = self.attn_backend.build_metadata(query_lens, seq_lens, tables, self.block_size)
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model(ids_t, pos_t, self.kv_caches, md)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward over all scheduled tokens, then sample where a token is due."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []  # index into the packed tokens of each sampled row
        sample_reqs = []
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(s.block_ids)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
        hidden = self._run_model(input_ids, positions, query_lens, seq_lens, tables)
        if not sample_reqs:
            return ModelRunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        banned = []
        for req in sample_reqs:
            sp = req.sampling_params
            gen = req.generator
            if gen is not None and gen.device != self.device:
                # Request makes its seeded generator on the CPU; remake it on the logits' device before
                # its first draw (it is used nowhere else, so no draw is lost).
                req.generator = make_generator(sp.seed, self.device)
            if req.num_output_tokens < sp.min_tokens:
                banned.append(sorted(set(req.eos_token_ids) | set(sp.stop_token_ids or [])))
            else:
                banned.append([])
        smd = SamplingMetadata.build(
            [r.sampling_params for r in sample_reqs],
            [r.prompt_token_ids for r in sample_reqs],
            [r.output_token_ids for r in sample_reqs],
            [r.generator for r in sample_reqs],
            banned,
            device=self.device,
        )
        out = self.sampler(logits, smd)
        token_ids = out.sampled_token_ids.tolist()
        sampled = {r.request_id: t for r, t in zip(sample_reqs, token_ids)}
        lps: dict[str, TokenLogprobs] = {}
        if out.logprobs is not None:
            lp = out.logprobs
            slp, rank = lp.sampled_logprob.tolist(), lp.sampled_rank.tolist()
            tids, tlps = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
            for i, r in enumerate(sample_reqs):
                n = r.sampling_params.logprobs
                if n is None:
                    continue
                lps[r.request_id] = TokenLogprobs(token_ids[i], slp[i], rank[i],
                                                  list(zip(tids[i][:n], tlps[i][:n])))
        return ModelRunnerOutput(sampled, lps)
