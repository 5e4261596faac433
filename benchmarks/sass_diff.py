# SPDX-License-Identifier: Apache-2.0
"""Do two trees' kernels compile to the same sm_90 machine code? (No GPU needed.) Each spec is
compiled by resources.py once with this tree's `src` on the path and once with the base's, and
the two SASS listings are compared byte for byte. Identical SASS for every launch a timing
covered means that timing holds for this tree: how a change that only moves kernel code
(helpers split out, arguments renamed) keeps the last GPU pass's numbers.

    git worktree add /tmp/base REV
    python3 benchmarks/sass_diff.py --base /tmp/base/src [specs...]   # exit status 1: differs

Specs are resources.py's (its docstring); the default covers the decode step's launches and
the attention's forms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = ["fp8,128,3,4", "bf16,64,3,4", "fp8,64,3,4", "bf16,64,3,8", "tile:bf16,64,3,4",
           "idec:fp8,16,32,3,4", "idec:bf16,16,32,3,4", "index:fp8,128,32,3,4",
           "sel:search,1024,64,1", "sel:sort,256,0,4", "prep:16", "prep:4",
           "amerge:8", "tmerge:search", "tmerge:sort"]


def sass(src: str, spec: str, tmp: str, name: str) -> str:
    dump = os.path.join(tmp, name)
    env = dict(os.environ, SASS_DUMP=dump, PYTHONPATH=src)
    subprocess.run([sys.executable, os.path.join(HERE, "resources.py"), "--sass", spec],
                   env=env, check=True, capture_output=True, text=True)
    with open(dump) as f:
        return f.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other tree's src directory")
    parser.add_argument("specs", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.base, "openmsa")):
        parser.error(f"--base must be a tree's src directory (holding openmsa/), got {args.base}")
    ours = os.path.join(os.path.dirname(HERE), "src")
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.specs:
            a, b = sass(args.base, spec, tmp, "base.sass"), sass(ours, spec, tmp, "ours.sass")
            same = a == b
            differ += not same
            print(f"{spec:24s} {'identical' if same else 'DIFFERS'} ({len(b.splitlines())} "
                  f"lines of SASS)", flush=True)
    print(f"{len(args.specs) - differ} of {len(args.specs)} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
