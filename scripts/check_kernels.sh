#!/usr/bin/env bash
# Compile-check every ibpcache/kernels/*.cu with nvcc for sm_80 and sm_90 (cubin into a temp dir; no GPU needed).
# Fails on any compiler error. At run time the sources are compiled by NVRTC through CuPy, so keep them free of
# host-only headers; this check catches syntax, type and template errors before a GPU run. A source whose leading
# comment lines say "// requires: a.cu ..." is checked as those files' text followed by its own, as
# ibpcache/kernels/_build.py compiles it.
# Usage: bash scripts/check_kernels.sh   (NVCC=/path/to/nvcc and NVCC_FLAGS="..." override the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
ARCHS=(sm_80 sm_90)
kernel_dir=ibpcache/kernels

shopt -s nullglob
sources=("$kernel_dir"/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_kernels: no $kernel_dir/*.cu files yet; nothing to check"
  exit 0
fi
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_kernels: ERROR: $NVCC not found; cannot check ${#sources[@]} CUDA source(s)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "check_kernels: $("$NVCC" --version | tail -n 1)"
failed=0
compiled_text() {  # the text _build.py hands NVRTC: required sources first (one level, like the package uses)
  local src=$1 dep
  for dep in $(sed -n '/^\/\//!q; s|^// requires:||p' "$src"); do
    cat "$kernel_dir/$dep"
    echo
  done
  cat "$src"
}
for src in "${sources[@]}"; do
  unit="$tmp/$(basename "$src")"
  compiled_text "$src" >"$unit"
  for arch in "${ARCHS[@]}"; do
    out="$tmp/$(basename "$src" .cu).$arch.cubin"
    # shellcheck disable=SC2086  # NVCC_FLAGS is a word list on purpose
    if "$NVCC" -std=c++17 --cubin -arch="$arch" -I"$kernel_dir" ${NVCC_FLAGS:-} -o "$out" "$unit"; then
      echo "  ok    $src ($arch, $(wc -c < "$out") bytes)"
    else
      echo "  FAIL  $src ($arch)" >&2
      failed=$((failed + 1))
    fi
  done
done
if [ "$failed" -ne 0 ]; then
  echo "check_kernels: $failed compile(s) failed" >&2
  exit 1
fi
echo "check_kernels: ${#sources[@]} source(s) x ${#ARCHS[@]} architectures compiled"
