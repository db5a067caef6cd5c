#!/usr/bin/env bash
# Does the host's memory have bandwidth to spare beyond what its cores draw? Runs the CPU AdamW
# (`zeroflow bench cpu-adam`) alone, page-locked copies both ways (torch) alone, and both at
# once, printing each side's rate per second. Runs on the GPU machine from the repository root
# with the CLI at .gpu/zeroflow (bash scripts/gpu-check.sh here; carry .gpu):
#
#   device run: carry [.gpu], command: bash scripts/host-bandwidth-probe.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B=${B:-.gpu/zeroflow}
PARAMS=${PARAMS:-5e8}
ITERS=${ITERS:-30}
COPY_SECONDS=${COPY_SECONDS:-40}
copies() {
    python3 - "$1" "$2" <<'PY'
import sys, time, torch
seconds, direction = float(sys.argv[1]), sys.argv[2]
n = 1 << 28  # 1 GiB of f32 each way
host_in = torch.empty(n, dtype=torch.float32, pin_memory=True).fill_(1.0)
host_out = torch.empty(n, dtype=torch.float32, pin_memory=True)
dev_in = torch.empty(n, dtype=torch.float32, device="cuda")
dev_out = torch.ones(n, dtype=torch.float32, device="cuda")
up, down = torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()
start = last = time.time(); moved = 0
while time.time() - start < seconds:
    if direction in ("h2d", "both"):
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True); moved += 4 * n
    if direction in ("d2h", "both"):
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True); moved += 4 * n
    torch.cuda.synchronize()
    now = time.time()
    if now - last >= 1.0:
        print(f"COPY t={now:.2f} {direction} {moved / (now - last) / 1e9:.1f} GB/s", flush=True)
        last, moved = now, 0
PY
}
adam() {
    echo "ADAM start $(date +%s.%N)"
    $B bench cpu-adam --params "$PARAMS" --iters "$ITERS" "$@"
    echo "ADAM end $(date +%s.%N)"
}
nproc; lscpu | grep -E "Model name|NUMA|Socket|Thread|Core" ; free -g | head -2
echo "== AdamW alone"; adam
echo "== copies alone (both directions)"; copies 6 both
echo "== copies alone (H2D)"; copies 4 h2d
echo "== AdamW beside copies both ways"
copies "$COPY_SECONDS" both & pid=$!; sleep 4; adam; wait $pid
echo "== AdamW beside H2D copies"
copies "$COPY_SECONDS" h2d & pid=$!; sleep 4; adam; wait $pid
echo "== AdamW with 12 threads beside copies both ways"
copies "$COPY_SECONDS" both & pid=$!; sleep 4; adam --threads 12; wait $pid
