"""Distributed pieces: the KV-transfer connectors (:mod:`tinyvllm.distributed.kv_transfer`) that move KV
blocks between engines (prefill/decode disaggregation)."""
