# SPDX-License-Identifier: Apache-2.0
"""decode_step's plan: the separate ops' launches of a step (cache/plan.py's preparation,
indexer/plan.py's scoring and selection, attention/plan.py's splits and merge) as the phases
of one launch (kernels/step.py), with each launch's constexprs unchanged; None for a step
whose launches are not of those kinds, which then runs them apart."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.plan import (DeviceFacts, Launch, LaunchPlan, cached_hash, check_form,
                           state_without_hash)

# the counters' slots (kernels/step.py): the ticket, the five phases' arrivals, the finished
# programs, the interpreter's error flag, then the attention's fused-merge counters
ERROR_SLOT = 7
HEAD_COUNTERS = 8

# the separate launches' flags that the one launch sets itself (programmatic dependent
# launches, the tile and NVFP4 forms it never takes, no LSE output); their launch options
# (lower case: num_warps, launch_pdl, ...) are the config's
_DROPPED = {"PDL", "WAIT_PRIOR", "WAIT_TILES", "TILE_MODE", "TILE_QT", "NVFP4", "INDEX_NVFP4",
            "STORE_LSE"}


@dataclass(frozen=True)
class StepConfig:
    """The one-launch decode step's knobs.

    max_tokens: decode and verify steps of at most this many tokens run as one launch; larger
    steps and prefill chunks run the ops apart.
    num_warps, num_stages: the launch's, one value for every phase. A reduction's order
    follows the warps, so the plan takes only steps whose preparation, scoring and selection
    launches run this many warps (4 at M3's shapes): their results, the selection included,
    are then bit-identical to the ops apart; the attention's, whose own launch may use other
    warps (8 at B <= 2), can differ in rounding.
    sleep_ns: a waiting program's pause between two polls of the counter it waits on (0: none,
    nanoseconds; the GPU rounds it)."""

    max_tokens: int = 8
    num_warps: int = 4
    num_stages: int = 3
    sleep_ns: int = 64

    def __post_init__(self):
        check_form(self, positive=("num_warps", "num_stages"))
        if self.sleep_ns > 1_000_000:
            # (PTX's nanosleep sleeps at most a millisecond)
            raise ValueError(f"StepConfig.sleep_ns must be at most 1000000, got {self.sleep_ns}")

    __hash__ = cached_hash
    __getstate__ = state_without_hash


DEFAULT = StepConfig()


def _prefixed(prefix: str, launch: Launch) -> dict:
    return {prefix + k: v for k, v in launch.params.items()
            if k.isupper() and k not in _DROPPED}


def plan(num_tokens: int, num_requests: int, prepare: LaunchPlan,
         indexer: LaunchPlan, attention: LaunchPlan, device: DeviceFacts,
         config: StepConfig = DEFAULT) -> tuple[Launch, dict] | None:
    """(the launch, its phase ends and buffer sizes) for a step of at most config.max_tokens
    tokens whose separate plans are: one preparation launch (not into NVFP4 pages); the Triton
    decode scoring launch alone (every request of at most its SMALL_Q tokens: decode and
    verify steps; the scan waits for the preparation, so a verify token's new keys are scored
    as written), the segment selection and its merge if any; the attention's split launch (no
    prefill tiles) and its merge if any; on an NVIDIA GPU or the interpreter. None otherwise.
    On the GPU the phases wait by spinning (SPIN); the interpreter, which runs programs in
    order, checks instead."""
    # (NVIDIA only: on ROCm the one launch has never been built or run)
    if not (0 < num_tokens <= config.max_tokens and (device.nvidia or not device.cuda)):
        return None
    if prepare.kernels() != ("fused_prepare",) or prepare.launches[0].params["INDEX_NVFP4"]:
        return None
    kernels = indexer.kernels()
    if kernels not in (("scores_decode", "select_segments"),
                       ("scores_decode", "select_segments", "select_merge")):
        return None
    scores, segments = indexer.launches[0], indexer.launches[1]
    if scores.params["NVFP4"] or scores.params["TILE_MODE"]:
        return None
    if attention.kernels() not in (("token",), ("token", "merge")) \
            or attention.launches[0].params["TILE_QT"]:
        return None
    prep, token = prepare.launches[0], attention.launches[0]
    # (the interpreter's reductions do not depend on the warps)
    if device.cuda and any(launch.params.get("num_warps", 4) != config.num_warps
                           for launch in (prep, *indexer.launches)):
        return None
    heads, kv_heads, q_heads = (segments.grid[1], token.grid[1],
                                token.params["NUM_HEADS"])
    ends = [num_tokens * prep.grid[1]]
    ends.append(ends[-1] + num_requests * scores.grid[1])
    ends.append(ends[-1] + num_tokens * heads * indexer.sizes["segments"])
    ends.append(ends[-1] + (num_tokens * heads if len(kernels) == 3 else 0))
    splits = token.params["SPLITS"]
    ends.append(ends[-1] + num_tokens * kv_heads * splits)
    total = ends[-1] + (num_tokens * q_heads if len(attention) == 2 else 0)
    params = {**_prefixed("P_", prep), "P_TILES": prep.grid[1],
              **_prefixed("S_", scores), "S_SPLITS": scores.grid[1],
              **_prefixed("G_", segments), **_prefixed("A_", token)}
    if len(kernels) == 3:
        merge = indexer.launches[2].params
        params.update(M_CANDP=merge["CANDP"], M_BY_SORT=merge["BY_SORT"])
    else:
        params.update(M_CANDP=0, M_BY_SORT=False)
    params.update(SPIN=device.cuda, SLEEP_NS=config.sleep_ns, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    sizes = dict(ends=tuple(ends), segments=indexer.sizes["segments"],
                 candidates=indexer.sizes["candidates"], scratch=indexer.sizes["scratch"],
                 splits=splits if splits > 1 else 0,
                 counters=HEAD_COUNTERS + num_tokens * kv_heads)
    return Launch("decode_step", (total,), params), sizes
