# SPDX-License-Identifier: Apache-2.0
"""Write the package as it was at a git revision into .ab/openmsa_base (git-ignored), the base
side of benchmarks/ab.py; carry `.ab` to the GPU machine.   python benchmarks/prepare_ab.py REV
(a second argument names another folder than .ab, e.g. .ab2: two bases in one device call;
.gitignore ignores folders named .ab*)"""

import io
import os
import shutil
import subprocess
import sys
import tarfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rev = sys.argv[1]
folder = os.path.join(root, sys.argv[2] if len(sys.argv) > 2 else ".ab")
dest = os.path.join(folder, "openmsa_base")
shutil.rmtree(dest, ignore_errors=True)
tar = subprocess.run(["git", "-C", root, "archive", rev, "src/openmsa"], check=True,
                     capture_output=True).stdout
with tarfile.open(fileobj=io.BytesIO(tar)) as t:
    for m in t.getmembers():
        if m.isfile():
            path = os.path.join(dest, os.path.relpath(m.name, "src/openmsa"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(t.extractfile(m).read())
with open(os.path.join(folder, "REVISION"), "w") as f:
    f.write(subprocess.run(["git", "-C", root, "rev-parse", "--short", rev], check=True,
                           capture_output=True, text=True).stdout)
print(f"{dest}: openmsa at {rev}")
