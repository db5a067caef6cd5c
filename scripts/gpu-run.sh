#!/usr/bin/env bash
# Runs on the GPU machine, with the binaries that scripts/gpu-check.sh staged in .gpu/:
# `zeroflow env`, the GPU test binaries in .gpu/tests/ (one test thread each, zeroflow-device's
# first), `zeroflow bench copy`, and `zeroflow bench gemm` where the binary has it. Full logs go to
# $OUT (the device tool's folder; .gpu/out elsewhere); a table of every `RESULT` line is printed
# last. Each step is cut off after STEP_TIMEOUT seconds (default 240), so that one hang (a
# collective waiting for a rank) leaves time for the rest.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/.gpu/out}
# Everything small under $OUT comes back from the device in one bundle (scripts/bundle-out.sh).
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# NVLink multicast must stay off on the lent machines: keep this in every environment.
export NCCL_NVLS_ENABLE=0
export ZEROFLOW_REQUIRE_GPU=1
export ZEROFLOW_PINNED_ITERS=${ZEROFLOW_PINNED_ITERS:-10000}
export ZEROFLOW_HAZARD_ITERS=${ZEROFLOW_HAZARD_ITERS:-200}
export RUST_BACKTRACE=1
STEP_TIMEOUT=${STEP_TIMEOUT:-240}

for required in .gpu/zeroflow .gpu/tests/zeroflow-device; do
    if [[ ! -x "$required" ]]; then
        echo "gpu-run: $required is missing: run scripts/gpu-check.sh here and carry .gpu" >&2
        exit 2
    fi
done

failed=()
notes=()
logs=()
step() { # step NAME COMMAND...: runs COMMAND with its output in $OUT/NAME.log, timing it.
    local name=$1 started=$SECONDS
    shift
    timeout -k 10 "$STEP_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    logs+=("$OUT/$name.log")
    if ((status == 124 || status == 137)); then
        echo "$name: TIMED OUT after $STEP_TIMEOUT s"
    else
        echo "$name: exit $status in $((SECONDS - started)) s"
    fi
    ((status == 0)) || failed+=("$name")
}

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
nvidia-smi topo -m >"$OUT/nvidia-topo.log" 2>&1 || true
ls -l /usr/lib/x86_64-linux-gnu/libnccl* /usr/local/cuda/lib64/libnvrtc.so* \
    /usr/local/cuda/lib64/libcublasLt.so* >"$OUT/libraries.log" 2>&1 || true
step env .gpu/zeroflow env
step env-json .gpu/zeroflow env --json

# The device tests first (the contract everything else stands on), then the others present.
for package in zeroflow-device zeroflow-nn zeroflow-gpt zeroflow-llama zeroflow-engine zeroflow-train; do
    binary=.gpu/tests/$package
    if [[ -x "$binary" ]]; then
        step "tests-$package" "$binary" --test-threads=1 --nocapture
    else
        notes+=("$package: no GPU test binary staged (skipped)")
    fi
done

step bench-copy .gpu/zeroflow bench copy --json
if .gpu/zeroflow bench gemm --help >/dev/null 2>&1; then
    step bench-gemm .gpu/zeroflow bench gemm
else
    notes+=("zeroflow bench gemm: not in this binary (skipped)")
fi

# The copy benchmark's JSON as RESULT lines, for the table.
python3 - "$OUT/bench-copy.log" >"$OUT/bench-copy-results.log" 2>/dev/null <<'EOF' || true
import json, sys
line = [l for l in open(sys.argv[1]) if l.startswith('{"bench"')][-1]
report = json.loads(line)
for r in report["results"]:
    print(f"RESULT bench_copy_{r['memory']} h2d_gbps={r['h2d_gbps']:.1f} "
          f"d2h_gbps={r['d2h_gbps']:.1f} both_gbps={r['both_gbps']:.1f} "
          f"host_read_gbps={r['host_read_gbps']:.1f}")
EOF
logs+=("$OUT/bench-copy-results.log")

echo
echo "==== zeroflow env"
cat "$OUT/env.log"
if [[ -f "$OUT/bench-gemm.log" ]]; then
    echo
    echo "==== zeroflow bench gemm (last lines)"
    tail -n 12 "$OUT/bench-gemm.log"
fi
echo
echo "==== test failures (if any)"
grep -h -A1 "panicked at" "${logs[@]}" 2>/dev/null | grep -v "^--$" | cut -c1-300 | head -24
grep -h "^test .* FAILED$\|^error" "${logs[@]}" 2>/dev/null | head -12
echo
echo "==== summary"
printf '%-34s %s\n' "what" "result"
for package in zeroflow-device zeroflow-nn zeroflow-gpt zeroflow-llama zeroflow-engine zeroflow-train; do
    log=$OUT/tests-$package.log
    [[ -f "$log" ]] || continue
    printf '%-34s %s\n' "$package tests" "$(grep -h '^test result' "$log" | head -1)"
    printf '%-34s %s\n' "$package skipped tests" "$(grep -c '^skipped: ' "$log")"
done
for note in "${notes[@]}"; do
    printf '%-34s %s\n' "note" "$note"
done
grep -h '^RESULT ' "${logs[@]}" 2>/dev/null | sed 's/^RESULT //' |
    while read -r what rest; do printf '%-34s %s\n' "$what" "$rest"; done
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]} (logs in $OUT)"
    exit 1
fi
echo "all steps passed (logs in $OUT)"
