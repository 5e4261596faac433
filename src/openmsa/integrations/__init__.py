# SPDX-License-Identifier: Apache-2.0
"""Integrations of openmsa into other libraries (each an optional dependency):
`openmsa.integrations.transformers.use_openmsa` runs transformers' MiniMax-M3 on openmsa."""
