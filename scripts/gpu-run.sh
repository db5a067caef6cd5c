#!/usr/bin/env bash
# Runs on the GPU machine, with the binaries that scripts/gpu-check.sh staged in .gpu/:
# `zeroflow env`, the CUDA tests (one thread), and the 1 GiB copy bandwidth measurement. Full logs
# go to $OUT (the device tool's folder; .gpu/out elsewhere); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
export ZEROFLOW_REQUIRE_GPU=1
export ZEROFLOW_PINNED_ITERS=${ZEROFLOW_PINNED_ITERS:-10000}
export ZEROFLOW_HAZARD_ITERS=${ZEROFLOW_HAZARD_ITERS:-200}
export RUST_BACKTRACE=1

for binary in .gpu/zeroflow .gpu/cuda-tests; do
    if [[ ! -x "$binary" ]]; then
        echo "gpu-run: $binary is missing: run scripts/gpu-check.sh here and carry .gpu" >&2
        exit 2
    fi
done

failed=()
step() { # step NAME COMMAND...: runs COMMAND with its output in $OUT/NAME.log, timing it.
    local name=$1 started=$SECONDS
    shift
    "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    echo "$name: exit $status in $((SECONDS - started)) s"
    ((status == 0)) || failed+=("$name")
}

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
ls -l /usr/lib/x86_64-linux-gnu/libnccl* /usr/local/cuda/lib64/libnvrtc.so* \
    /usr/local/cuda/lib64/libcublasLt.so* >"$OUT/libraries.log" 2>&1 || true
step env .gpu/zeroflow env
step env-json .gpu/zeroflow env --json
step cuda-tests .gpu/cuda-tests --test-threads=1 --nocapture
step bandwidth .gpu/cuda-tests --ignored --test-threads=1 --nocapture bandwidth

echo
echo "==== zeroflow env"
cat "$OUT/env.log"
echo
echo "==== test failures (if any)"
grep -h -A1 "panicked at" "$OUT/cuda-tests.log" "$OUT/bandwidth.log" | grep -v "^--$" | head -24
echo
echo "==== summary"
printf '%-28s %s\n' "what" "result"
printf '%-28s %s\n' "cuda tests" "$(grep -h '^test result' "$OUT/cuda-tests.log" | head -1)"
printf '%-28s %s\n' "skipped tests" "$(grep -c 'skipped: no CUDA device' "$OUT/cuda-tests.log")"
grep -h '^RESULT ' "$OUT/cuda-tests.log" "$OUT/bandwidth.log" | sed 's/^RESULT //' |
    while read -r what rest; do printf '%-28s %s\n' "$what" "$rest"; done
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]} (logs in $OUT)"
    exit 1
fi
echo "all steps passed (logs in $OUT)"
