"""EngineArgs: the one list of engine options, from which the CLI flags and the (frozen) configs are made."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from tinyvllm.config import (CacheConfig, EngineArgs, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig)

CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)


def test_engine_args_cover_every_config_field_once_with_its_default():
    args = {f.name: f for f in dataclasses.fields(EngineArgs)}
    seen: list[str] = []
    for klass in CONFIGS:
        for f in dataclasses.fields(klass):
            if klass is ParallelConfig and f.name in ("torchrun_rank", "data_parallel_rank"):
                continue  # from torchrun's environment (RANK) / set per replica by the API process, not flags
            assert f.name in args, f"{klass.__name__}.{f.name} has no EngineArgs field"
            assert args[f.name].default == f.default, f.name
            seen.append(f.name)
    # speculative_config is a config of its own (a JSON object of vLLM's keys -> SpeculativeConfig)
    assert sorted(seen) == sorted(set(args) - {"speculative_config"}), \
        "an EngineArgs field must belong to exactly one config"
    assert all(f.metadata["help"] for f in args.values())


def test_configs_are_frozen_and_normalised():
    cfg = EngineArgs(kv_cache_memory="512MiB", block_size=32, max_num_seqs=8).create_engine_config()
    assert isinstance(cfg, EngineConfig)
    assert cfg.cache_config.kv_cache_memory == 512 << 20 and cfg.cache_config.block_size == 32
    assert cfg.scheduler_config.max_num_seqs == 8
    for obj, name in ((cfg, "cache_config"), (cfg.model_config, "device"), (cfg.cache_config, "block_size"),
                      (cfg.scheduler_config, "max_num_seqs")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    assert dataclasses.replace(cfg.model_config, device="cpu").device == "cpu"
    assert ModelConfig().device == EngineArgs().device == "auto"  # one default for LLM() and the CLI


def test_from_kwargs_goes_through_engine_args():
    cfg = EngineConfig.from_kwargs(block_size=8, seed=3, scheduling_policy="static", enable_chunked_prefill=False,
                                   max_waiting_requests=2)
    assert cfg == EngineArgs(block_size=8, seed=3, scheduling_policy="static", enable_chunked_prefill=False,
                             max_waiting_requests=2).create_engine_config()
    assert cfg.model_config.seed == 3 and cfg.scheduler_config.enable_chunked_prefill is False
    with pytest.raises(TypeError, match="unknown engine option 'no_such_option'"):
        EngineConfig.from_kwargs(no_such_option=1)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_kwargs(block_size=0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig.from_kwargs(scheduling_policy="fifo")


def test_cli_flags_are_made_from_the_fields():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args([])) == EngineArgs()
    a = EngineArgs.from_cli_args(p.parse_args(
        ["--model", "m", "--dtype", "float32", "--max-model-len", "64", "--block-size", "32", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "128", "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB",
         "--num-kv-blocks", "9", "--scheduling-policy", "static", "--seed", "5", "--device", "cpu",
         "--enforce-eager", "--load-format", "dummy"]))
    assert a == EngineArgs(model="m", dtype="float32", max_model_len=64, block_size=32, max_num_seqs=4,
                           max_num_batched_tokens=128, enable_prefix_caching=False, kv_cache_memory="2GiB",
                           num_kv_blocks=9, scheduling_policy="static", seed=5, device="cpu", enforce_eager=True,
                           load_format="dummy")
    for bad in (["--scheduling-policy", "fifo"], ["--load-format", "pt"], ["--block-size", "x"],
                ["--enable-chunked-prefill"], ["--max-waiting-requests", "3"], ["--no-enforce-eager"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    server = argparse.ArgumentParser()
    EngineArgs.add_cli_args(server, group="server")
    assert EngineArgs.from_cli_args(server.parse_args(["--max-waiting-requests", "3"])).max_waiting_requests == 3


def test_config_imports_no_torch():
    code = "import sys, tinyvllm.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
