# SPDX-License-Identifier: Apache-2.0
"""Arrival counters of the fused merges: the last program of a group of split programs to
arrive (an atomic add on its group's counter) merges their partial results, so no second
launch is made. The merger puts its counter back to 0, so the buffer holds zeros between
launches and graph replays.

One buffer per (device, stream, role): launches on one stream never overlap, and a second stream
(or a graph's forked stream) gets its own buffer; the role (the op using them) keeps two ops
apart even where one op's programs start under another's (programmatic
dependent launches).
No buffer is ever freed: a captured graph keeps using the address it saw, so a buffer outgrown
by a larger step is retired but kept. A buffer first made while a graph is being captured lives
in the graph's pool and its zero fill is replayed with the graph (correct, about a microsecond
per replay): make one eager call on the capturing stream first."""

import torch

COUNTERS: dict[tuple[int, int, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int, role: str) -> torch.Tensor:
    """At least n int32 zeros for this device, the current stream and `role`."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    # the raw query: torch.cuda.current_stream() builds a Stream object, host time on every
    # call (benchmarks/host_cost.py)
    key = (index, torch._C._cuda_getCurrentRawStream(index), role)
    buf = COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        COUNTERS[key] = buf
    return buf
