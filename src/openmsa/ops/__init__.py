# SPDX-License-Identifier: Apache-2.0
"""MSA's ops, one folder each: indexer (index branch), attention (main branch), cache (writes and
per-layer preparation). Each folder holds README.md (the math), reference.py (the spec in code),
the Triton kernels and api.py (validation + dispatch)."""
