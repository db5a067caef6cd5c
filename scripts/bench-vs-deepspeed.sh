#!/usr/bin/env bash
# Runs on the GPU machine: zeroflow's `bench step` / `bench gpt` and the peers (PyTorch forward +
# backward, DeepSpeed ZeRO-2 on the GPU, with CPU offload, and ZenFlow) on the same models, one
# after the other, and optionally the CPU AdamW row (`zeroflow bench cpu-adam` against
# DeepSpeedCPUAdam and torch's AdamW). Every result is appended as one JSON line (system, mode,
# model, ... plus the run's date) to $OUT/bench.jsonl; a table of ratios is printed last.
# scripts/bench-report.py turns one or more such files into BENCHMARKS.md's tables and the plots.
#
#   here:  bash scripts/gpu-check.sh          (builds the release binary, stages .gpu/zeroflow)
#          bench/peers/fetch-wheels.sh        (once: DeepSpeed into .peers/)
#   there: bash scripts/bench-vs-deepspeed.sh gpt2-350m gpt-1.3b     carry: [".gpu", ".peers"]
#
# Arguments: the models (named sizes; default $MODELS, else gpt-1.3b).
# Environment:
#   PARTS     what to run, any of: zeroflow (bench step per mode), fwd-bwd (zeroflow bench gpt and
#             the PyTorch forward+backward floor), deepspeed (ds_train.py per DS mode), cpu-adam
#             (the CPU AdamW row, once, not per model). Default "zeroflow fwd-bwd deepspeed".
#   MODES     zeroflow modes (default "gpu offload offload-delayed zenflow")
#   DS_MODES  DeepSpeed modes (default "gpu offload zenflow")
#   STEPS (10), WARMUP (4), MICRO_BATCH (8), CPU_ADAM_PARAMS (5e8), CPU_ADAM_THREADS (nproc)
#   SEQ       sequence length for every system (default: each one's own, 1024)
#   CHECKPOINTING=1  activation checkpointing everywhere: zeroflow's --activation-checkpointing,
#             the peers' --gradient-checkpointing (transformers' own)
#   Llama shapes (llama-1b, llama-3b, llama-8b) run as LlamaForCausalLM in the peers, e.g.
#   MICRO_BATCH=4 SEQ=2048 bash scripts/bench-vs-deepspeed.sh llama-1b
#   ZF_ARGS   more arguments for zeroflow's `bench step` rows (e.g. "--state-dtype bf16")
#   OUT       where logs and bench.jsonl go (default $OUT of the device tool, else .gpu/out)
#   SKIP_DS=1 / SKIP_ZF=1 still work (drop deepspeed / zeroflow+fwd-bwd from PARTS).
#
# One device call may run 600 s at most. Measured on 2026-11-30 (gpt-1.3b, 14 steps each): a
# zeroflow mode takes well under a minute, a DeepSpeed mode about one to two (import, the CPU Adam
# op's JIT build the first time, pinning). The split for gpt2-350m + gpt-1.3b, one device call
# each, all writing $OUT/bench.jsonl (fetch each call's file and concatenate them):
#   A: PARTS="zeroflow fwd-bwd"                  bash scripts/bench-vs-deepspeed.sh gpt2-350m gpt-1.3b
#   B: PARTS=deepspeed DS_MODES="gpu offload"    bash scripts/bench-vs-deepspeed.sh gpt2-350m gpt-1.3b
#   C: PARTS="deepspeed cpu-adam" DS_MODES=zenflow bash scripts/bench-vs-deepspeed.sh gpt2-350m gpt-1.3b
# Each command is bounded (timeout per run), so a slow part loses its own row, not the call.
set -uo pipefail
cd "$(dirname "$0")/.."

if (($# > 0)); then MODELS="$*"; fi
MODELS=${MODELS:-gpt-1.3b}
PARTS=${PARTS:-zeroflow fwd-bwd deepspeed}
[[ -n "${SKIP_DS:-}" ]] && PARTS=${PARTS//deepspeed/}
[[ -n "${SKIP_ZF:-}" ]] && PARTS=$(sed 's/zeroflow//; s/fwd-bwd//' <<<"$PARTS")
MODES=${MODES:-gpu offload offload-delayed zenflow}
DS_MODES=${DS_MODES:-gpu offload zenflow}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-4}
MICRO_BATCH=${MICRO_BATCH:-8}
CPU_ADAM_PARAMS=${CPU_ADAM_PARAMS:-5e8}
CPU_ADAM_THREADS=${CPU_ADAM_THREADS:-$(nproc)}
OUT=${OUT:-$PWD/.gpu/out}
# Everything small under $OUT comes back from the device in one bundle (scripts/bundle-out.sh).
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
RUN_DATE=${RUN_DATE:-$(date -u +%F)}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
export PYTHONUNBUFFERED=1
RESULTS=$OUT/bench.jsonl
touch "$RESULTS"
Z=${ZEROFLOW:-.gpu/zeroflow}
SEQ_ARGS=()
[[ -n "${SEQ:-}" ]] && SEQ_ARGS=(--seq "$SEQ")
ZF_CKPT=() PEER_CKPT=()
[[ -n "${CHECKPOINTING:-}" ]] && ZF_CKPT=(--activation-checkpointing) PEER_CKPT=(--gradient-checkpointing)
read -ra ZF_EXTRA <<<"${ZF_ARGS:-}"
has_part() { [[ " $PARTS " == *" $1 "* ]]; }
echo "bench-vs-deepspeed: models [$MODELS], parts [$PARTS], $RUN_DATE, results in $RESULTS"
# The machine, for BENCHMARKS.md's "Machine:" line.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
echo "$(nproc) cores; $(grep MemTotal /proc/meminfo)"

# emit LOG KEY=VALUE...: appends every JSON object in LOG (one per line, or one pretty-printed
# object) to $RESULTS as one line, with the given fields added where the object lacks them and
# the run's date. Prints the number of objects; fails (status 1) if there were none.
emit() {
    python3 - "$RESULTS" "$RUN_DATE" "$@" <<'PY'
import json, sys
results, run_date, log, *fields = sys.argv[1:]
text = open(log, errors="replace").read()
extra = dict(field.split("=", 1) for field in fields)
decoder, objects, i = json.JSONDecoder(), [], 0
while (i := text.find("{", i)) >= 0:
    if i == 0 or text[i - 1] == "\n":
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        # Results only: DeepSpeed's logs may hold other JSON (its config).
        if isinstance(value, dict) and ({"system", "bench", "optimizer"} & value.keys()):
            objects.append(value)
        i = end
    else:
        i += 1
with open(results, "a") as out:
    for value in objects:
        for key, field in extra.items():
            value.setdefault(key, field)
        value.setdefault("run_date", run_date)
        out.write(json.dumps(value) + "\n")
print(f"  {len(objects)} result(s) from {log}")
sys.exit(0 if objects else 1)
PY
}


for MODEL in $MODELS; do
    if has_part zeroflow; then
        for mode in $MODES; do
            log=$OUT/zeroflow-$MODEL-$mode.log
            timeout 300 $Z bench step --device cuda --model "$MODEL" --mode "$mode" \
                --micro-batch "$MICRO_BATCH" "${SEQ_ARGS[@]}" "${ZF_CKPT[@]}" --steps "$STEPS" \
                --warmup "$WARMUP" "${ZF_EXTRA[@]}" --json >"$log" 2>"$log.err"
            echo "zeroflow $MODEL $mode: exit $?"
            emit "$log" || tail -n 5 "$log" "$log.err"
        done
    fi
    if has_part fwd-bwd; then
        log=$OUT/zeroflow-$MODEL-fwd-bwd.log
        timeout 200 $Z bench gpt --model "$MODEL" --micro-batch "$MICRO_BATCH" "${SEQ_ARGS[@]}" \
            "${ZF_CKPT[@]}" >"$log" 2>&1
        echo "zeroflow $MODEL fwd-bwd: exit $?"
        # The RESULT line (key=value pairs) as a JSON object.
        python3 - "$log" >"$log.json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("RESULT gpt_fwd_bwd "):
        fields = dict(pair.split("=", 1) for pair in line.split()[2:])
        row = {"system": "zeroflow", "mode": "fwd-bwd"}
        for key, value in fields.items():
            try:
                row[key] = int(value)
            except ValueError:
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = value
        row["s_per_step_median"] = row.pop("s_per_step", None)
        print(json.dumps(row))
PY
        emit "$log.json" || tail -n 5 "$log"
        log=$OUT/torch-$MODEL.log
        timeout 300 python3 bench/peers/gpt_fwd_bwd.py --model "$MODEL" --micro-batch "$MICRO_BATCH" \
            "${SEQ_ARGS[@]}" "${PEER_CKPT[@]}" >"$log" 2>&1
        echo "pytorch $MODEL fwd-bwd: exit $?"
        emit "$log" mode=fwd-bwd || tail -n 5 "$log"
    fi
    if has_part deepspeed; then
        bash bench/peers/install-deepspeed.sh
        export PYTHONPATH=/tmp/site RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
        port=${port:-29600}
        for mode in $DS_MODES; do
            port=$((port + 1))
            log=$OUT/deepspeed-$MODEL-$mode.log
            MASTER_PORT=$port timeout 400 python3 bench/peers/ds_train.py --mode "$mode" \
                --model "$MODEL" --micro-batch "$MICRO_BATCH" "${SEQ_ARGS[@]}" "${PEER_CKPT[@]}" \
                --steps "$STEPS" --warmup "$WARMUP" >"$log" 2>&1
            echo "deepspeed $MODEL $mode: exit $?"
            emit "$log" || tail -n 5 "$log"
        done
    fi
done

if has_part cpu-adam; then
    log=$OUT/zeroflow-cpu-adam.log
    timeout 200 $Z bench cpu-adam --params "$CPU_ADAM_PARAMS" --threads "$CPU_ADAM_THREADS" \
        --grad f32 --json >"$log" 2>&1
    echo "zeroflow cpu-adam: exit $?"
    emit "$log" system=zeroflow mode=cpu-adam optimizer=zeroflow || tail -n 5 "$log"
    bash bench/peers/install-deepspeed.sh
    log=$OUT/peers-cpu-adam.log
    PYTHONPATH=/tmp/site timeout 400 python3 bench/peers/cpu_adam.py --params "$CPU_ADAM_PARAMS" \
        --threads "$CPU_ADAM_THREADS" >"$log" 2>"$log.err"
    echo "peers cpu-adam: exit $?"
    # The peers' objects name the optimizer; the system is DeepSpeed for DeepSpeedCPUAdam, else
    # PyTorch.
    python3 - "$log" >"$log.json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        row = json.loads(line)
        row.setdefault("system", "deepspeed" if row.get("optimizer") == "deepspeed" else "pytorch")
        row.setdefault("mode", "cpu-adam")
        print(json.dumps(row))
PY
    emit "$log.json" || tail -n 5 "$log" "$log.err"
fi

python3 - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def find(system, mode, model):
    for r in rows:
        if r.get("system") == system and r.get("mode") == mode and r.get("model") == model:
            return r
# GPU memory: zeroflow reports all memory in use on the device (its context included), the
# PyTorch-based peers torch.cuda.max_memory_allocated (their caching allocator's peak, without the
# context's few hundred MiB).
nan = float("nan")
print(f"\n{'system':10} {'model':10} {'mode':16} {'s/step':>8} {'tokens/s':>9} {'fwd+bwd s':>9} "
      f"{'exposed opt s':>13} {'RSS B/param':>11} {'GPU GiB':>7} {'steal %':>7}")
for r in rows:
    if r.get("mode") == "cpu-adam":
        print(f"{r['system']:10} {'':10} {'cpu-adam':16} {r.get('optimizer', '')}: "
              f"{r.get('gparams_per_s', nan):.2f} Gparam/s {r.get('skipped', '')}")
        continue
    gpu = r.get("device_memory_in_use_bytes")
    gpu = gpu / 2**30 if gpu else r.get("peak_gib", r.get("device_used_gib", nan))
    # The hypervisor's share of the host's CPU time in the timed steps (both systems report it).
    steal = r.get("host_steal_fraction")
    steal = nan if steal is None else steal
    print(f"{r['system']:10} {r.get('model', ''):10} {r.get('mode', ''):16} "
          f"{r.get('s_per_step_mean') or r.get('s_per_step_median') or nan:8.4f} "
          f"{r.get('tokens_per_s', nan):9.0f} {r.get('forward_backward_s_mean', nan):9.4f} "
          f"{r.get('exposed_optimizer_s_mean', nan):13.4f} "
          f"{r.get('peak_rss_bytes_per_param') or nan:11.1f} {gpu:7.1f} {100 * steal:7.2f}")
print()
models = sorted({r["model"] for r in rows if r.get("model")})
pairs = [("gpu", "deepspeed", "gpu"), ("offload", "deepspeed", "offload"),
         ("offload-delayed", "deepspeed", "offload"), ("offload-delayed", "deepspeed", "zenflow"),
         ("zenflow", "deepspeed", "zenflow"),
         ("fwd-bwd", "pytorch", "fwd-bwd")]
for model in models:
    for ours, system, theirs in pairs:
        a, b = find("zeroflow", ours, model), find(system, theirs, model)
        if a and b:
            print(f"RATIO {model} zeroflow {ours} / {system} {theirs}: "
                  f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s")
PY
