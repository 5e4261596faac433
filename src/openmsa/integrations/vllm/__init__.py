# SPDX-License-Identifier: Apache-2.0
"""vLLM's MiniMax-M3 on openmsa: a `vllm.general_plugins` entry point (`register`) that makes
openmsa the indexer and the sparse attention of vLLM's MiniMax-M3 layers, with no change to
vLLM's files.

What `register` does, in every vLLM process: it re-registers vLLM's MiniMax-M3 architectures
(`MiniMaxM3SparseForCausalLM`, `MiniMaxM3SparseForConditionalGeneration`, `MiniMaxM3MTP`) under
`openmsa.integrations.vllm.model`, a module that loads vLLM's own model classes and, before any
layer is built, rebinds the two selectors the M3 layer calls (`select_indexer_impl_cls` and
`select_main_backend_and_impl_cls`, `select_main_impl_cls` in vLLM 0.24-0.26). The new selectors
give each layer openmsa's impls (`OpenMSAIndexerImpl`: one `select_blocks` call per layer into
vLLM's shared top-k buffer; `OpenMSASparseImpl`: `sparse_attention` over vLLM's packed K|V
pages), or vLLM's own impl with the reason in the log where `openmsa.unsupported_reason` (or a
vLLM-side limit) says openmsa cannot run the layer. On vLLM's CPU platform it also puts CPU
stand-ins in place of the CUDA-only pieces of vLLM's M3 layer (`cpu.py`). Nothing is loaded
before a MiniMax-M3 model is, so other models see no change.

`OPENMSA_VLLM=0` (or `false` / `off`) turns the plugin off; `VLLM_PLUGINS`, vLLM's allowlist of
plugin names, can leave it out too (its name is `openmsa`).
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "enabled", "ARCHITECTURES", "ENV"]

ENV = "OPENMSA_VLLM"
# vLLM's MiniMax-M3 architectures (its model registry's names)
ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
                 "MiniMaxM3MTP")
# a child of vLLM's logger, so that vLLM's log handlers and level apply
logger = logging.getLogger("vllm.openmsa")


def enabled() -> bool:
    """False when the environment turns the plugin off (`OPENMSA_VLLM=0`, `false`, `off`)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value not in ("", "1", "true", "on", "yes"):
        raise ValueError(f"{ENV} must be 0/1 (or false/true, off/on), got {value!r}")
    return True


def register() -> None:
    """The `vllm.general_plugins` entry point: route vLLM's MiniMax-M3 architectures through
    `openmsa.integrations.vllm.model` (loaded only when such a model is)."""
    if not enabled():
        logger.info("openmsa: the vLLM plugin is off (%s=%s)", ENV, os.environ.get(ENV))
        return
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"openmsa.integrations.vllm.model:{arch}")
    logger.debug("openmsa: MiniMax-M3 architectures routed through openmsa.integrations.vllm")
