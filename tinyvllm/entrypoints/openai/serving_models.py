"""``GET /v1/models``."""

from __future__ import annotations

import time

from tinyvllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    """The served model names, as OpenAI's model list."""

    def list_models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "tinyvllm",
             "root": str(self.engine.resolved.model_dir), "parent": None, "max_model_len": self.engine.max_model_len}
            for name in self.served_model_names]}
