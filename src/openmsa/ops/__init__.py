# SPDX-License-Identifier: Apache-2.0
"""MSA's ops, one folder each: indexer (index branch), attention (main branch), cache (writes and
per-layer preparation). Each folder holds README.md (the math), reference.py (docs/spec.md in
code), the kernels, plan.py (the op's config dataclass and its pure launch plan) and api.py
(check the arguments, get the cached plan, run it); common/ holds what they share."""
