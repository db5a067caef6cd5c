#!/usr/bin/env bash
# The multi-GPU acceptance matrix (a), on `nvidia-h200-x2`, with the zeroflow binary that
# scripts/gpu-check.sh staged in .gpu/ (or ZEROFLOW=path): for ZeRO-1 and ZeRO-2, each with the
# optimizer on the GPU and offloaded to the CPU (examples/configs/{zero1,zero2}[-offload]-bf16.json),
# bf16, gpt2-124m, STEPS (50) steps of a global batch of 8 sequences on the synthetic corpus:
#
#   one:  1 GPU, --micro-batch 8;
#   two:  `zeroflow launch --nproc-per-node 2`, --micro-batch 4 (the same sequences, split);
#   ref:  1 GPU, --micro-batch 4 --accum 2 (the same computation in another order on one GPU: how
#         far bf16 reordering alone moves the weights, the bound `two` is judged against);
#
# then scripts/compare-runs.py compares `two` (and `ref`) with `one`: the loss curves, and the
# final checkpoints' model.safetensors. One RESULT line per variant: `match` or `differ`.
#
#   here:  bash scripts/gpu-check.sh
#   there: run  kind: nvidia-h200-x2  command: bash scripts/gpu-multi-matrix.sh  carry: [".gpu"]
#
# The 12 runs take about 4 minutes (a 50-step gpt2-124m run is ~15 s of wall time on an H200). A
# variant is not started when less than 90 s of BUDGET (560 s) is left; it is listed as skipped,
# and a second call with VARIANTS="…" runs the rest. Environment: VARIANTS (default "zero1 zero2
# zero1-offload zero2-offload"), STEPS, MODEL, NO_REF=1 (skip the `ref` runs; then the weights'
# bound is compare-runs.py's --weight-tol). Logs and run directories go under $OUT/matrix.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/.gpu/out}
# Everything small under $OUT comes back from the device in one bundle (scripts/bundle-out.sh).
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
DIR=$OUT/matrix
mkdir -p "$DIR"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# NVLink multicast must stay off on the lent machines: keep this in every environment.
export NCCL_NVLS_ENABLE=0
export RUST_BACKTRACE=1
ZEROFLOW=${ZEROFLOW:-.gpu/zeroflow}
MODEL=${MODEL:-gpt2-124m}
STEPS=${STEPS:-50}
VARIANTS=${VARIANTS:-zero1 zero2 zero1-offload zero2-offload}
BUDGET=${BUDGET:-560}
# Without --config, --micro-batch, --accum and --out, which each run adds.
COMMON=(--device cuda --model "$MODEL" --lr 6e-4 --steps "$STEPS" --eval-every 0 --save-every 0
    --log-every 10)

results=()
result() { results+=("$*"); echo "RESULT $*"; }

nvidia-smi >"$DIR/nvidia-smi.log" 2>&1 || true

# run NAME COMMAND...: one run, its output in $DIR/NAME.log, its directory $DIR/NAME.
run() {
    local name=$1 started=$SECONDS
    shift
    rm -rf "${DIR:?}/$name"
    timeout 240 "$@" --out "$DIR/$name" >"$DIR/$name.log" 2>&1
    local status=$?
    result "$name status=$status seconds=$((SECONDS - started))"
    ((status == 0)) || tail -5 "$DIR/$name.log"
}

for variant in $VARIANTS; do
    config=examples/configs/$variant-bf16.json
    if [[ ! -f "$config" ]]; then
        result "$variant skipped: no $config"
        continue
    fi
    if ((SECONDS > BUDGET - 90)); then
        result "$variant skipped: ${SECONDS} s of the ${BUDGET} s budget used; run it in another call"
        continue
    fi
    run "$variant-one" "$ZEROFLOW" train "${COMMON[@]}" --config "$config" --micro-batch 8
    run "$variant-two" "$ZEROFLOW" launch --nproc-per-node 2 -- \
        train "${COMMON[@]}" --config "$config" --micro-batch 4
    reference=()
    if [[ -z "${NO_REF:-}" ]]; then
        run "$variant-ref" "$ZEROFLOW" train "${COMMON[@]}" --config "$config" --micro-batch 4 \
            --accum 2
        reference=(--reference "$DIR/$variant-ref")
    fi
    # Without the CUDA library path, which can shadow the interpreter's own libpython.
    env -u LD_LIBRARY_PATH python3 scripts/compare-runs.py "$DIR/$variant-one" "$DIR/$variant-two" "${reference[@]}" \
        --label "$variant" 2>&1 | tee "$DIR/$variant-compare.log"
done

echo
echo "== results (${SECONDS} s)"
printf '%s\n' "${results[@]}"
grep -h '^RESULT' "$DIR"/*-compare.log 2>/dev/null
