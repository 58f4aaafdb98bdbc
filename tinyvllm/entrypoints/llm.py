"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

from typing import Any, Sequence

from tinyvllm.config import DEFAULT_MODEL, EngineConfig
from tinyvllm.engine.llm_engine import LLMEngine, PromptType
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams


class LLM:
    """An LLM for offline batched generation.

    Args:
        model: alias, ``.gguf`` path or Hugging Face model directory.
        dtype: ``auto`` (bfloat16), ``bfloat16`` or ``float32``.
        **kwargs: engine options under vLLM's names, the fields of
            :class:`~tinyvllm.config.EngineArgs` (the CLI's flags, same defaults): ``block_size``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
            ``max_model_len``, ``kv_cache_memory`` (bytes or ``'2GiB'``),
            ``num_kv_blocks``, ``scheduling_policy`` (``continuous``/``static``), ``seed``,
            ``device`` (``auto``: CUDA if available, else CPU)...

    Raises:
        ModelNotFoundError: the model cannot be found (message says how to install it).
        TypeError: an unknown option.
        ValueError: an invalid option value.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", **kwargs: Any) -> None:
        preloaded = kwargs.pop("_preloaded_model", None)  # tests: share weights between engines
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype, **kwargs), model=preloaded)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for all prompts at once (continuous batching); outputs in prompt order.

        A prompt is a string or ``{"prompt_token_ids": [...]}``.

        Raises:
            ValueError: an invalid prompt (empty, too long for ``max_model_len``).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return self._run([(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False, **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (list of messages) or several, using the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        sp = sampling_params or SamplingParams()
        reqs = [({"prompt_token_ids": self.llm_engine.chat_prompt_ids(c, add_generation_prompt,
                                                                     **chat_template_kwargs)}, sp)
                for c in convs]
        return self._run(reqs, use_tqdm)

    def _run(self, reqs: list[tuple[PromptType, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        ids = []
        try:
            for p, sp in reqs:
                ids.append(eng.add_request(p, sp))
        except Exception:
            for rid in ids:
                eng.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def stats(self) -> dict:
        """The engine's cumulative statistics (see :meth:`EngineCore.stats`)."""
        return self.llm_engine.core.stats()
