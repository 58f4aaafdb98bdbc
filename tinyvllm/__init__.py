"""tinyvllm: a small, fast LLM inference engine and OpenAI-compatible server."""

from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
