"""``POST /tokenize`` (a prompt, or messages through the chat template) and ``POST /detokenize``."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from tinyvllm.engine.async_llm import InvalidRequestError
from tinyvllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.openai.serving_engine import (OpenAIServing, error_response, exception_response,
                                                        run_blocking)


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize and detokenize with the served model's tokenizer."""

    async def tokenize(self, req: TokenizeRequest) -> Response:
        if (err := self.check_model(req.model)) is not None:
            return err
        try:
            if (req.prompt is None) == (req.messages is None):
                raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
            if req.messages is not None:
                # The chat template already places the special tokens (as for chat completions).
                ids = await run_blocking(self._chat_prompt_ids, req, req.messages, req.add_generation_prompt)
            else:
                ids = await run_blocking(self._encode, req.prompt,
                                         True if req.add_special_tokens is None else req.add_special_tokens)
        except ValueError as e:
            return exception_response(e)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        if (err := self.check_model(req.model)) is not None:
            return err
        vocab = self.engine.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            return error_response(f"tokens must be in [0, {vocab})", 400, "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})
