#!/usr/bin/env bash
# FlashInfer's dense paged attention sources for the GPU machine (the layer sections' "engine
# dense" baseline: its paged decode wrapper with tensor cores and its FA3 prefill wrapper, which
# FlashInfer compiles on first use). The shared tool prepare-flashinfer.sh carries only the
# sources of FlashInfer's MSA programs; this adds the top-level sources and templates of
# flashinfer/data/csrc and CUTLASS's host utility headers (data/cutlass/tools/util/include,
# which the FA3 prefill includes through flashinfer/cutlass_utils.cuh; about 0.7 MB packed)
# into the git-ignored .peers-fi-dense/.
#   here:            bash scripts/prepare_flashinfer_dense.sh
#   on the GPU:      after `bash .peers/install.sh`: bash .peers-fi-dense/install.sh
set -euo pipefail
VERSION=${FLASHINFER_VERSION:-0.7.4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform any -d "$work" "flashinfer-python==$VERSION"
( cd "$work" && unzip -q flashinfer_python-*.whl 'flashinfer/data/csrc/*' \
    'flashinfer/data/cutlass/tools/util/include/*' \
  && { find flashinfer/data/csrc -maxdepth 1 -type f
       find flashinfer/data/cutlass/tools/util/include -type f; } | sort > keep \
  && tar cJf csrc.tar.xz -T keep )
mkdir -p .peers-fi-dense
cp "$work/csrc.tar.xz" .peers-fi-dense/
cat > .peers-fi-dense/install.sh <<'INNER'
#!/usr/bin/env bash
# GPU machine: FlashInfer's dense attention sources into the FlashInfer that .peers/install.sh
# unpacked (/tmp/peers).
set -e
[ -d /tmp/peers/flashinfer ] || { echo "run .peers/install.sh first" >&2; exit 1; }
tar xJf "$(dirname "$0")/csrc.tar.xz" -C /tmp/peers && echo "FlashInfer dense sources and CUTLASS util headers installed"
INNER
echo "FlashInfer $VERSION dense attention sources in .peers-fi-dense/ ($(du -sh .peers-fi-dense | cut -f1))"
