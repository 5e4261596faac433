# SPDX-License-Identifier: Apache-2.0
"""The barrier protocol of attention/tile_gluon.py's partitions, modelled on the CPU (the Gluon
kernel cannot run without a Hopper GPU, and a protocol mistake there hangs the GPU call instead
of failing a test). Each partition is written out below as the sequence of its mbarrier waits,
arrivals and shared-memory reads and writes, in the kernel's order (kept in step with
tile_gluon.py by hand); a scheduler interleaves them at random. Checked: every partition
finishes (no deadlock), every read of a ring slot sees the step it expects, and no copy lands in
a slot that a partition still reads."""

import random

import pytest

pytestmark = pytest.mark.reference


class Barrier:
    """An mbarrier of one expected arrival per phase: wait(parity) passes once the phase of
    that parity has completed (PTX try_wait.parity), i.e. while the current phase's parity
    differs."""

    def __init__(self):
        self.completed = 0

    def arrive(self):
        self.completed += 1

    def passes(self, parity):
        return (self.completed & 1) != parity


class Ring:
    def __init__(self, name, depth):
        self.name = name
        self.ready = [Barrier() for _ in range(depth)]
        self.empty = [Barrier() for _ in range(depth)]
        self.held = [None] * depth      # which step's tile the slot holds
        self.readers = [0] * depth      # partitions reading the slot now

    def __len__(self):
        return len(self.ready)


def _wait(bar, parity, pred=True):
    return ("wait", bar, parity) if pred else ("nop",)


def producer(k, v, steps):
    for i in range(steps):
        s = i % len(k)
        yield _wait(k.empty[s], ((i // len(k)) & 1) ^ 1, i >= len(k))
        yield ("write", k, s, i)
        s = i % len(v)
        yield _wait(v.empty[s], ((i // len(v)) & 1) ^ 1, i >= len(v))
        yield ("write", v, s, i)


def consumer(k, v, steps, early_release=False):
    """_consumer (one step at a time: the keys go back once S = Q K^T has read them, the
    values after P V; the fp8 loader fills the same rings). early_release: a broken consumer
    that hands its keys back before it is done reading them."""
    for step in range(steps):
        s = step % len(k)
        yield _wait(k.ready[s], (step // len(k)) & 1)
        if early_release:
            yield ("arrive", k.empty[s])
        yield ("read", k, s, step)
        yield ("done", k, s)
        if not early_release:
            yield ("arrive", k.empty[s])
        s = step % len(v)
        yield _wait(v.ready[s], (step // len(v)) & 1)
        yield ("read", v, s, step)
        yield ("done", v, s)
        yield ("arrive", v.empty[s])


def _run(actors, seed):
    rng = random.Random(seed)
    pending = {name: next(gen, None) for name, gen in actors.items()}
    while any(op is not None for op in pending.values()):
        runnable = [n for n, op in pending.items()
                    if op is not None and (op[0] != "wait" or op[1].passes(op[2]))]
        assert runnable, f"deadlock: {[(n, op[0]) for n, op in pending.items() if op]}"
        name = rng.choice(runnable)
        op = pending[name]
        if op[0] == "write":
            ring, s, step = op[1:]
            assert ring.readers[s] == 0, f"{name} overwrote {ring.name}[{s}] while it was read"
            ring.held[s] = step
            ring.ready[s].arrive()  # (the TMA copy's completion)
        elif op[0] == "read":
            ring, s, step = op[1:]
            assert ring.held[s] == step, f"{name} read {ring.name}[{s}]: {ring.held[s]} != {step}"
            ring.readers[s] += 1
        elif op[0] == "done":
            op[1].readers[op[2]] -= 1
        elif op[0] == "arrive":
            op[1].arrive()
        pending[name] = next(actors[name], None)


@pytest.mark.parametrize("sk, sv", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)])
def test_partitions_never_deadlock_nor_race(sk, sv):
    for steps in range(0, 9):
        for seed in range(30):
            k, v = Ring("k", sk), Ring("v", sv)
            _run(dict(producer=producer(k, v, steps),
                      consumer=consumer(k, v, steps)), seed)


def test_the_model_catches_a_race():
    # keys handed back before S has read them: some interleaving lets the producer refill the
    # slot under the reader (or the reader see the next step's keys)
    with pytest.raises(AssertionError, match="overwrote|read"):
        for seed in range(100):
            k, v = Ring("k", 1), Ring("v", 1)
            _run(dict(producer=producer(k, v, 6), consumer=consumer(k, v, 6, True)), seed)
