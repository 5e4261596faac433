# SPDX-License-Identifier: Apache-2.0
"""vLLM's MiniMax-M3 model classes, with openmsa's selectors (and, on vLLM's CPU platform, the
CPU stand-ins) installed before any layer is built: the module `register` points vLLM's model
registry at. The classes are vLLM's own objects, re-exported."""

from __future__ import annotations

import sys

from . import cpu, impls, logger

__all__ = ["install", "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
           "MiniMaxM3MTP"]

# where vLLM's M3 layer looks its main-branch selector up (the model modules import it by name)
# and the selector's name: 0.27 on, (backend, impl); 0.24-0.26, the impl only
_MAIN_SELECTORS = (("select_main_backend_and_impl_cls", True), ("select_main_impl_cls", False))
_MODEL_MODULES = ("vllm.models.minimax_m3.common.sparse_attention",
                  "vllm.models.minimax_m3.nvidia.model", "vllm.models.minimax_m3.nvidia.mtp",
                  "vllm.models.minimax_m3.amd.model", "vllm.models.minimax_m3.amd.mtp")


def _rebind(module, name: str, make) -> bool:
    current = getattr(module, name, None)
    if current is None or hasattr(current, "openmsa_original"):
        return current is not None
    setattr(module, name, make(current))
    return True


def install() -> None:
    """Rebind the M3 layer's two selectors to openmsa's (idempotent); on vLLM's CPU platform,
    put the CPU stand-ins in place."""
    # importing the package imports the platform's model module (nvidia/ or amd/)
    import vllm.models.minimax_m3  # noqa: F401
    from vllm.models.minimax_m3.common import indexer as vindexer
    from vllm.platforms import current_platform

    # the layer's indexer looks `select_indexer_impl_cls` up in common/indexer.py at call time
    if not _rebind(vindexer, "select_indexer_impl_cls", impls.make_indexer_selector):
        raise RuntimeError("openmsa: this vLLM's MiniMax-M3 indexer has no "
                           "select_indexer_impl_cls to choose openmsa with")
    found = False
    for module_name in _MODEL_MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, returns_backend in _MAIN_SELECTORS:
            found |= _rebind(module, name, lambda f, r=returns_backend:
                             impls.make_main_selector(f, returns_backend=r))
    if not found:
        raise RuntimeError("openmsa: this vLLM's MiniMax-M3 layer has neither "
                           "select_main_backend_and_impl_cls nor select_main_impl_cls")
    if current_platform.is_cpu():
        cpu.install()
    logger.info("openmsa: vLLM's MiniMax-M3 layers choose openmsa's indexer and sparse "
                "attention where openmsa can run them (OPENMSA_VLLM=0 turns this off)")


install()

from vllm.models.minimax_m3 import (MiniMaxM3MTP, MiniMaxM3SparseForCausalLM,  # noqa: E402
                                    MiniMaxM3SparseForConditionalGeneration)
