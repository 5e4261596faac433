# SPDX-License-Identifier: Apache-2.0
"""A stand-in for a Triton kernel that records one argument of each launch."""

__all__ = ["RecordingKernel"]


class RecordingKernel:
    """Stands in for a Triton kernel (monkeypatched over it): launches it as `kernel[grid](...)`
    does and appends the launch's positional argument number `arg` to `seen`, so a test can check
    what a kernel wrote (e.g. which prefill tiles it took) without a hook in the library."""

    def __init__(self, kernel, seen: list, arg: int):
        self.kernel, self.seen, self.arg = kernel, seen, arg

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.append(args[self.arg])
            return launch(*args, **kwargs)
        return run
