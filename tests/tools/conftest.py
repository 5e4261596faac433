# SPDX-License-Identifier: Apache-2.0
"""Tests of the tools beside the library, not of the library: benchmarks/'s bookkeeping, figures,
doc section, offline resource counts and smoke runs of its scripts. The tiers and fixtures are
tests/conftest.py's; here benchmarks/ goes on sys.path, so that its scripts import as modules
(`import run`, `import shapes`)."""

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
