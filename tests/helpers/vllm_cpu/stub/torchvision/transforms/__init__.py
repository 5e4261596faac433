# SPDX-License-Identifier: Apache-2.0
"""Test stub (see ../../../sitecustomize.py): the one name vLLM's MiniMax-M3 image processor
imports at module level."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
