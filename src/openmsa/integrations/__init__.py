# SPDX-License-Identifier: Apache-2.0
"""Integrations of openmsa into other libraries (each an optional dependency):
`openmsa.integrations.transformers.use_openmsa` runs transformers' MiniMax-M3 on openmsa;
`openmsa.integrations.vllm` is the vLLM plugin that runs vLLM's MiniMax-M3 on openmsa."""

import importlib

__all__ = ["transformers", "vllm"]


def __getattr__(name):
    # each integration on first use: importing one needs its library
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
