"""Speculative decoding: draft tokens proposed on the CPU, verified by the target model in one step.

* :mod:`.ngram_proposer`: prompt lookup (``{"method": "ngram"}``);
* :mod:`.suffix_proposer`: SuffixDecoding (``{"method": "suffix"}``);
* :mod:`.policy`: when to speculate (a cost model from measured step times);
* :mod:`.drafter`: the engine core's side (propose, validate against a grammar, size, learn);
* :mod:`.rejection_sampler`: the worker's side (verify; exact for greedy, distribution-preserving
  under sampling).

The layout follows vLLM's ``v1/spec_decode/``; docs/speculative-decoding.md is the user's page.
"""
