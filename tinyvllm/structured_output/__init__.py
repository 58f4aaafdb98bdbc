"""Structured outputs: grammar-constrained decoding with xgrammar.

``backend_xgrammar`` compiles constraints and validates them (the API server's 400s); ``manager``
compiles off the step loop and builds each step's token bitmask, which travels in the
``SchedulerOutput`` and is applied to the sampled rows' logits by the model runner.
"""

from tinyvllm.structured_output.backend_xgrammar import GrammarError, XgrammarBackend, validate
from tinyvllm.structured_output.manager import RequestGrammar, StructuredOutputManager

__all__ = ["GrammarError", "RequestGrammar", "StructuredOutputManager", "XgrammarBackend", "validate"]
