"""LLMEngine: tokenizer + output processor + an in-process EngineCore (the offline path)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.input_processor import check_prompt, fan_out
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLMEngine:
    """Synchronous engine: add requests, call :meth:`step` until no request is left."""

    def __init__(self, config: EngineConfig, model: Any = None) -> None:
        self.config = config
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs replicas behind an API server: use tinyvllm serve "
                             "--data-parallel-size N (the offline engine runs one engine core)")
        self.core = EngineCore(config, model=model)
        self.tokenizer = load_tokenizer(self.core.resolved.model_dir)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.core.model.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def model_name(self) -> str:
        return self.core.resolved.served_name

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids).

        Raises:
            ValueError: an empty prompt or an unsupported prompt type.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])  # checked by check_prompt
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize_prompt(prompt["prompt"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt must be a non-empty string or {'prompt_token_ids': [...]}")

    def chat_prompt_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        **kwargs: Any) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> str:
        """Tokenize and queue a request (its ``n`` samples); return its id.

        Raises:
            ValueError: invalid prompt or prompt too long for ``max_model_len``.
        """
        rid = request_id or f"req-{next(self._ids)}"
        text, ids = self.tokenize_prompt(prompt)
        check_prompt(ids, params, self.core.max_model_len, self.core.model_info.vocab_size)
        now = time.monotonic()
        reqs = fan_out(rid, ids, params, self.eos_token_ids, now)
        self.output_processor.add_request(rid, text, ids, params, now)
        try:
            for r in reqs:
                self.core.add_request(r)
        except ValueError:
            self.abort_request(rid)
            raise
        return rid

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Run one engine step; return outputs of requests that progressed."""
        outs, to_abort = self.output_processor.process_outputs(self.core.step(), delta=delta)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outs
