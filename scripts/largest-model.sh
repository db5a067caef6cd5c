#!/usr/bin/env bash
# Runs on the GPU machine: the largest GPT that trains, per system and mode, on one GPU (H200,
# 139.8 GiB) and its host (128 GiB). For each (system, mode) it walks a ladder of sizes: from a
# starting rung up while steps complete, or down while they fail, and records every attempt as one
# JSON line ({"bench": "largest-model", system, mode, n_layer, d_model, n_head, parameters, status,
# error, ...}) in $OUT/largest.jsonl; scripts/bench-report.py makes the table from it. An attempt
# is `zeroflow bench step --device cuda --model '<JSON>' --steps 2 --warmup 1` or
# `bench/peers/ds_train.py --n-layer L --d-model D --n-head H --steps 2 --warmup 1`, bounded by
# ATTEMPT_TIMEOUT; status is ok, device-oom, host-oom, timeout or error (with the last error line).
#
#   here:  bash scripts/gpu-check.sh && bench/peers/fetch-wheels.sh
#   there: SYSTEMS=zeroflow MODES=offload bash scripts/largest-model.sh      carry: [".gpu", ".peers"]
#
# Environment: SYSTEMS ("zeroflow"; or "deepspeed", or both), MODES (default "offload gpu"; zeroflow
# also knows offload-delayed), FAMILY (gpt2, or llama: the Llama ladder below), SEQ (the family's
# context: 1024, 2048), CHECKPOINTING=1 (activation checkpointing in both systems), STATE_DTYPE
# (zeroflow's --state-dtype: fp32, or bf16 for 16-bit Adam moments; recorded in each row),
# MICRO_BATCH (4), STEPS (2), WARMUP (1), ATTEMPT_TIMEOUT (200 s),
# BUDGET (560 s: no attempt starts that could end later than this many seconds after the script
# started; the device tool stops a call at 600 s), RUNGS (the ladder, "LAYERSxWIDTH" from small to
# large), START_<system>_<mode> (the first rung tried, e.g. START_zeroflow_offload=44x4096).
#
# The ladder: GPT-2 shapes with vocabulary 50304, context 1024, head width 128; 24 and 48 layers at
# d 2048, then d 4096 in steps of 4 layers (0.8 B parameters):
#   24x2048 1.31 B   48x2048 2.52 B   16x4096 3.43 B   20x4096 4.24 B   24x4096 5.04 B
#   28x4096 5.85 B   32x4096 6.65 B   36x4096 7.46 B   40x4096 8.27 B   44x4096 9.07 B
#   48x4096 9.88 B   52x4096 10.68 B  56x4096 11.49 B
#
# FAMILY=llama: Llama-3 shapes (LlamaForCausalLM in DeepSpeed's peer), head width 128, 8 key/value
# heads, vocabulary 128256, untied embeddings, rope theta 500000; intermediate 14336 at width 4096
# (llama-8b's) and 13824 at width 5120; "LAYERSxWIDTH":
#   8x4096 2.80 B    12x4096 3.67 B   16x4096 4.54 B   20x4096 5.41 B   24x4096 6.28 B
#   32x4096 8.03 B   36x4096 8.90 B   40x4096 9.78 B   44x4096 10.65 B  48x4096 11.52 B
#   44x5120 13.42 B  48x5120 14.52 B  52x5120 15.62 B  54x5120 16.17 B  56x5120 16.72 B
# zeroflow offload with checkpointing (4 x 2048) keeps 12.14 B/param of host memory at llama-8b
# (measured), 8.1 with bf16 moments (planned): the host's ~125 GiB available end it near 44x4096
# (fp32 moments) and 54x5120 (bf16). `bench step` checks its memory plan before allocating: a rung
# the plan refuses is recorded as status "plan" (a failure, with the plan's message), at no cost.
#
# Estimates that pick the starting rungs (so that each (system, mode) needs 2-4 attempts).
# Device: 139.8 GiB = 150 GB; host: 128 GiB = 137 GB, of which ~5 GB is not ours.
# zeroflow activations (bf16, micro-batch 4, ActLayout in crates/zeroflow-gpt/src/plan.rs): per
# layer 2·(18·n·d + 4·n + B·heads·T²) bytes with n = B·T (0.87 GB at d 4096), plus logits and
# probabilities 4·n·V (0.8 GB); their gradients are packed by liveness (a few layers' worth).
#   zeroflow offload:  host 12 B/param (fp32 master, m, v) + ~1 GB fixed (12.8 B/param measured at
#                      1.31 B); init peaks at 6 B/param before that. Device 4 B/param (bf16 weights
#                      and gradients) + activations: 9.88 B -> host 120 GB, device 82 GB; 10.68 B ->
#                      host 129 GB (the edge); 11.49 B -> 139 GB (over). Expect the limit at 48-52
#                      layers of d 4096 (~10-10.7 B): start at 44x4096 (9.07 B, the >= 8 B target).
#   zeroflow offload-delayed: as offload, plus 4 B/param on the device (gradients and weights set
#                      aside): also host-bound, the same rungs.
#   zeroflow gpu:      device 20 B/param (bf16 weights 2 + gradients 2, fp32 master 4, m 4, v 4,
#                      gradient accumulator 4) + activations: 5.04 B -> 123 GB, 5.85 B -> 142 GB
#                      (the edge), 6.65 B -> 162 GB (over). Start at 24x4096.
#   DeepSpeed offload: host 26.1 B/param measured at 1.31 B (fp32 master, m, v, fp32 gradients,
#                      pinned buffers): 4.24 B -> 111 GB, 5.04 B -> 132 GB (the edge), 5.85 B ->
#                      153 GB (over). Start at 20x4096. (The model is built on the GPU,
#                      --init-device cuda, which spares the host the fp32 copy: the limit found is
#                      DeepSpeed's best case.)
#   DeepSpeed gpu:     device ~16 B/param (bf16 weights 2 + gradients 2, fp32 master 4, m 4, v 4;
#                      fp32 gradient partition at step time) + HF activations (~70 B per token and
#                      unit of width per layer, from the 32.9 GiB PyTorch peak at gpt-1.3b): 5.85 B
#                      -> ~127 GB, 6.65 B -> ~144 GB (the edge). Start at 28x4096.
# Time per attempt: init of the weights on the CPU (~55 ns per parameter per thread, measured on a
# 2-core CI host: ~30-40 s for 8-10 B on 16 cores), the bf16 copy, pinning 12 B/param, 3 steps
# (CPU AdamW ~4.5 Gparam/s): ~60-100 s at 8-10 B; DeepSpeed adds its import and, the first time
# in a machine, the CPU Adam op's JIT build (~1 min). Split over device calls (600 s each):
#   SYSTEMS=zeroflow  MODES=offload                    (4 attempts, ~6 min)
#   SYSTEMS=zeroflow  MODES=gpu BUDGET=240             (after bench-vs-deepspeed.sh's zeroflow part)
#   SYSTEMS=deepspeed MODES="gpu offload"              (4-5 attempts, ~6-7 min)
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

SYSTEMS=${SYSTEMS:-zeroflow}
MODES=${MODES:-offload gpu}
MICRO_BATCH=${MICRO_BATCH:-4}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
ATTEMPT_TIMEOUT=${ATTEMPT_TIMEOUT:-200}
BUDGET=${BUDGET:-560}
FAMILY=${FAMILY:-gpt2}
STATE_DTYPE=${STATE_DTYPE:-fp32}
if [[ $FAMILY == llama ]]; then
    SEQ=${SEQ:-2048}
    DEFAULT_RUNGS="8x4096 12x4096 16x4096 20x4096 24x4096 32x4096 36x4096 40x4096 44x4096 48x4096 44x5120 48x5120 52x5120 54x5120 56x5120"
else
    SEQ=${SEQ:-1024}
    DEFAULT_RUNGS="24x2048 48x2048 16x4096 20x4096 24x4096 28x4096 32x4096 36x4096 40x4096 44x4096 48x4096 52x4096 56x4096"
fi
RUNGS=(${RUNGS:-$DEFAULT_RUNGS})
ZF_CKPT=() PEER_CKPT=()
[[ -n "${CHECKPOINTING:-}" ]] && ZF_CKPT=(--activation-checkpointing) PEER_CKPT=(--gradient-checkpointing)
OUT=${OUT:-$PWD/.gpu/out}
# Everything small under $OUT comes back from the device in one bundle (scripts/bundle-out.sh).
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
RUN_DATE=${RUN_DATE:-$(date -u +%F)}
RESULTS=$OUT/largest.jsonl
mkdir -p "$OUT"
touch "$RESULTS"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
export PYTHONUNBUFFERED=1
Z=${ZEROFLOW:-.gpu/zeroflow}

default_start() { # default_start SYSTEM MODE: the estimate's starting rung
    if [[ $FAMILY == llama ]]; then
        case "$1 $2 $STATE_DTYPE" in
        "zeroflow offload bf16") echo 54x5120 ;;
        "zeroflow offload fp32") echo 44x4096 ;;
        "deepspeed offload"*) echo 16x4096 ;;
        *) echo 32x4096 ;;
        esac
        return
    fi
    case "$1 $2" in
    "zeroflow offload" | "zeroflow offload-delayed") echo 44x4096 ;;
    "zeroflow gpu") echo 24x4096 ;;
    "deepspeed offload") echo 20x4096 ;;
    "deepspeed gpu") echo 28x4096 ;;
    *) echo 24x2048 ;;
    esac
}

# The host's limits, for the record.
echo "largest-model: systems [$SYSTEMS], modes [$MODES], micro-batch $MICRO_BATCH, $RUN_DATE"
grep -E 'MemTotal|MemAvailable' /proc/meminfo
cgroup_max=$(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo unknown)
echo "cgroup memory.max: $cgroup_max; locked-memory limit (ulimit -l): $(ulimit -l)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null
oom_kills() { # the cgroup's count of OOM kills (0 where there is no cgroup v2 file)
    awk '$1 == "oom_kill" { n = $2 } END { print n + 0 }' /sys/fs/cgroup/memory.events 2>/dev/null || echo 0
}


llama_ffn() { # llama_ffn WIDTH: the Llama ladder's intermediate size at that width
    case $1 in 4096) echo 14336 ;; 5120) echo 13824 ;; *) echo $((($1 * 8 / 3 + 255) / 256 * 256)) ;; esac
}

# attempt SYSTEM MODE RUNG: runs one size; prints ok or the failure's status; appends the JSON line.
attempt() {
    local system=$1 mode=$2 rung=$3
    local layers=${rung%x*} width=${rung#*x}
    local heads=$((width / 128))
    local left=$((BUDGET - (SECONDS - started)))
    local limit=$((left < ATTEMPT_TIMEOUT ? left : ATTEMPT_TIMEOUT))
    local log=$OUT/largest-$system-$mode-$rung.log
    if ((limit < 60)); then
        echo "budget"
        return
    fi
    local before
    before=$(oom_kills)
    local begin=$SECONDS
    # The OOM killer, if the host runs out, takes this attempt first.
    local run=(bash -c 'echo 1000 >/proc/self/oom_score_adj; exec "$@"' _)
    local ffn=$(llama_ffn "$width")
    if [[ $system == zeroflow ]]; then
        local json="{\"n_layer\":$layers,\"n_head\":$heads,\"d_model\":$width,\"vocab_size\":50304,\"context\":1024}"
        [[ $FAMILY == llama ]] && json="{\"architectures\":[\"LlamaForCausalLM\"],\"num_hidden_layers\":$layers,\"hidden_size\":$width,\"num_attention_heads\":$heads,\"num_key_value_heads\":8,\"intermediate_size\":$ffn,\"vocab_size\":128256,\"tie_word_embeddings\":false,\"rope_theta\":500000.0,\"max_position_embeddings\":8192,\"rms_norm_eps\":1e-5}"
        local dtype=()
        [[ $mode != gpu ]] && dtype=(--state-dtype "$STATE_DTYPE")
        timeout "$limit" "${run[@]}" $Z bench step --device cuda --model "$json" --mode "$mode" \
            --micro-batch "$MICRO_BATCH" --seq "$SEQ" "${ZF_CKPT[@]}" "${dtype[@]}" \
            --steps "$STEPS" --warmup "$WARMUP" --json >"$log" 2>&1
    else
        # A fresh port per attempt (this runs in a subshell: a counter would not advance).
        local port=$((29700 + RANDOM % 1000))
        local shape=(--n-layer "$layers" --d-model "$width" --n-head "$heads")
        [[ $FAMILY == llama ]] && shape+=(--llama-kv-heads 8 --llama-ffn "$ffn" --vocab 128256)
        PYTHONPATH=/tmp/site RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            timeout "$limit" "${run[@]}" python3 bench/peers/ds_train.py --mode "$mode" \
            "${shape[@]}" --init-device cuda --seq "$SEQ" "${PEER_CKPT[@]}" \
            --micro-batch "$MICRO_BATCH" --steps "$STEPS" --warmup "$WARMUP" >"$log" 2>&1
    fi
    local rc=$?
    python3 - "$RESULTS" "$log" "$rc" "$((SECONDS - begin))" "$(($(oom_kills) - before))" <<PY
import json, re, sys
results, log, rc, seconds, kills = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
text = open(log, errors="replace").read()
layers, width, heads, ffn = $layers, $width, $heads, $ffn
family = "$FAMILY"
if family == "llama":
    vocab, context, kv = 128256, $SEQ, 8
    per_layer = 2 * width * width + 2 * width * kv * 128 + 3 * width * ffn + 2 * width
    parameters = 2 * vocab * width + layers * per_layer + width
else:
    vocab, context = 50304, 1024
    parameters = vocab * width + context * width + layers * (12 * width * width + 13 * width) + 2 * width
row = {"bench": "largest-model", "system": "$system", "mode": "$mode", "family": family,
       "n_layer": layers, "d_model": width, "n_head": heads, "vocab_size": vocab, "context": context,
       "parameters": parameters, "seq": $SEQ, "checkpointing": bool("${ZF_CKPT[*]}"),
       "state_dtype": "$STATE_DTYPE" if "$system" == "zeroflow" and "$mode" != "gpu" else "fp32",
       "micro_batch": $MICRO_BATCH, "steps": $STEPS, "warmup": $WARMUP, "exit": rc,
       "seconds": seconds, "run_date": "$RUN_DATE", "log": log.rsplit("/", 1)[-1]}
result = None
for match in re.finditer(r"^\{", text, re.M):
    try:
        value, _ = json.JSONDecoder().raw_decode(text, match.start())
    except ValueError:
        continue
    if isinstance(value, dict) and "tokens_per_s" in value:
        result = value
lines = [l.strip() for l in text.splitlines() if l.strip()]
errors = [l for l in lines if re.search(r"error|Error|memory|Killed|panicked|failed", l)]
error = (errors or lines or [""])[-1][:300]
def has(pattern):
    return re.search(pattern, text) is not None
if rc == 0 and result:
    row.update(status="ok", error="")
    row["tokens_per_s"] = result.get("tokens_per_s")
    row["s_per_step_mean"] = result.get("s_per_step_mean")
    row["peak_rss_bytes"] = result.get("peak_rss_bytes")
    gpu = result.get("device_memory_in_use_bytes")
    row["device_memory_bytes"] = gpu if gpu else int(result.get("peak_gib", 0) * 2**30) or None
elif "the memory plan does not fit this machine" in text:
    row.update(status="plan", error=error)
elif rc == 124:
    row.update(status="timeout", error=f"no result within {seconds} s")
elif has(r"out of (pinned )?host memory|memory allocation of \d+ bytes failed|"
         r"DefaultCPUAllocator|Cannot allocate memory|can't allocate memory"):
    row.update(status="host-oom", error=error)
elif has(r"out of device memory|CUDA out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|"
         r"CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|NOT_ENOUGH_MEMORY"):
    row.update(status="device-oom", error=error)
elif rc in (137, -9) or kills > 0:
    row.update(status="host-oom",
               error=f"killed (exit {rc}; cgroup oom_kill events during the attempt: {kills})")
else:
    row.update(status="error", error=error)
with open(results, "a") as out:
    out.write(json.dumps(row) + "\n")
print(row["status"])
PY
}

# ladder SYSTEM MODE: up from the starting rung while attempts pass, down while they fail (out of
# memory or time); an error that is neither stops the ladder: its log says what went wrong.
ladder() {
    local system=$1 mode=$2
    local var=START_${system}_${mode//-/_}
    local start=${!var:-$(default_start "$system" "$mode")}
    local index=-1 i
    for i in "${!RUNGS[@]}"; do [[ ${RUNGS[$i]} == "$start" ]] && index=$i; done
    if ((index < 0)); then
        echo "largest-model: start rung $start is not in RUNGS" >&2
        return
    fi
    local direction=0 status best=none failed=none
    while ((index >= 0 && index < ${#RUNGS[@]})); do
        status=$(attempt "$system" "$mode" "${RUNGS[$index]}")
        echo "$system $mode ${RUNGS[$index]}: $status ($((SECONDS - started)) s in)"
        if [[ $status == budget ]]; then
            echo "  out of time (BUDGET $BUDGET s): stopped"
            break
        elif [[ $status == error ]]; then
            echo "  not a memory failure (see the log): stopped"
            failed=${RUNGS[$index]}
            break
        elif [[ $status == ok ]]; then
            best=${RUNGS[$index]}
            ((direction < 0)) && break # came down to one that trains
            direction=1
            index=$((index + 1))
        else
            failed=${RUNGS[$index]}
            ((direction > 0)) && break # went up to the first that fails
            direction=-1
            index=$((index - 1))
        fi
    done
    echo "RESULT largest $system $mode: trains $best; fails $failed"
}

for system in $SYSTEMS; do
    [[ $system == deepspeed ]] && bash bench/peers/install-deepspeed.sh
    for mode in $MODES; do
        ladder "$system" "$mode"
    done
done
echo "results: $RESULTS"
