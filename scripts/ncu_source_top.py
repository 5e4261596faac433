# SPDX-License-Identifier: Apache-2.0
"""Summarise scripts/ncu_source.sh's CSV (Nsight Compute's per-SASS-instruction page): the
instructions with the most excess shared-memory wavefronts (bank conflicts) and the most warp
stall samples, each with its address and SASS text.

    python3 scripts/ncu_source_top.py src-CASE.csv [top]"""

import csv
import sys


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, top: int = 15) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    body = [dict(zip(names, r)) for r in rows[head + 1:] if len(r) == len(names)]
    total = {k: sum(_num(r.get(k, "0")) for r in body) for k in
             ("L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive",
              "Warp Stall Sampling (All Samples)", "Instructions Executed")}
    print(path, {k: f"{v:.3g}" for k, v in total.items()})
    for key in ("L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared",
                "Warp Stall Sampling (All Samples)"):
        print(f"-- top by {key}")
        for r in sorted(body, key=lambda r: -_num(r.get(key, "0")))[:top]:
            stalls = sorted(((n[6:], _num(r[n])) for n in names
                             if n.startswith("stall_") and "Not Issued" not in n),
                            key=lambda x: -x[1])[:2]
            print(f"{r['Address']:>6s} {_num(r.get(key, '0')):10.3g}  ideal "
                  f"{_num(r.get('L1 Wavefronts Shared Ideal', '0')):9.3g}  "
                  f"{r['Source'][:60]:60s} {stalls}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
