# SPDX-License-Identifier: Apache-2.0
"""What a model on openmsa refuses: `generate` modes that reorder or crop the cache or bring
their own cache or loop (the sparse layers' pages follow one cache, in order), and saving (the
sparse layers' weights are fused). `generate` also gets a default prefill chunk size."""

from __future__ import annotations

import functools


def guard_generate(model, prefill_chunk_size: int | None) -> None:
    """Wrap `model.generate`: refuse what openmsa's caches cannot follow, and prefill in chunks
    of `prefill_chunk_size` unless the call or the generation config says otherwise."""
    generate = model.generate

    @functools.wraps(generate)
    def guarded(*args, **kwargs):
        gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

        def opt(name, default=None):
            if name in kwargs:
                return kwargs[name]
            return getattr(gc, name, default) if gc is not None else default

        if (opt("num_beams", 1) or 1) > 1:
            raise ValueError(f"use_openmsa: beam search (num_beams={opt('num_beams')}) is not "
                             f"supported (it reorders the cache)")
        if kwargs.get("assistant_model") is not None or opt("prompt_lookup_num_tokens"):
            raise ValueError("use_openmsa: assisted / prompt-lookup decoding is not supported "
                             "(it crops the cache)")
        if opt("penalty_alpha"):
            raise ValueError("use_openmsa: contrastive search (penalty_alpha) is not supported")
        if opt("cache_implementation") not in (None, "dynamic"):
            raise ValueError(f"use_openmsa: cache_implementation="
                             f"{opt('cache_implementation')!r} is not supported (the sparse "
                             f"layers keep their own paged caches; use the default dynamic "
                             f"cache)")
        if kwargs.get("custom_generate") is not None:
            raise ValueError("use_openmsa: custom_generate is not supported")
        if prefill_chunk_size is not None and "prefill_chunk_size" not in kwargs \
                and getattr(gc, "prefill_chunk_size", None) is None:
            kwargs["prefill_chunk_size"] = prefill_chunk_size  # (None in the call: no chunks)
        return generate(*args, **kwargs)

    model.generate = guarded


def refuse_save(*args, **kwargs):
    raise ValueError("use_openmsa: a model whose sparse layers run openmsa cannot be saved (its "
                     "attention weights are fused); save the model before use_openmsa")
