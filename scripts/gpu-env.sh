# Sourced by the GPU machine's scripts, from the repository root: the CUDA and NCCL libraries'
# paths, NVLink multicast off (keep it so on the lent machines), $OUT (the device tool's folder,
# else .gpu/out) created and bundled at exit (scripts/bundle-out.sh), and $Z, the zeroflow binary
# (ZEROFLOW, else the one scripts/gpu-check.sh staged).
#
#   cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
Z=${ZEROFLOW:-$PWD/.gpu/zeroflow}
