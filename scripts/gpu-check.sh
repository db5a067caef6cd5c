#!/usr/bin/env bash
# Builds the GPU checks on this machine (no CUDA needed: the libraries are loaded at run time) and
# stages the binaries in .gpu/ (ignored by git), for the device tool to carry to the GPU machine:
#
#   bash scripts/gpu-check.sh
#   run  command: bash scripts/gpu-run.sh   carry: [".gpu"]   (timeout 420 s or less)
#
# scripts/gpu-run.sh is what runs there; it writes its logs under $OUT and prints a table last.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release
# The test binary's path is in cargo's JSON messages (its name carries a hash).
test_binary=$(
    cargo test -p zeroflow-device --test cuda --no-run --release --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "cuda" \
            and message["profile"]["test"] and message.get("executable"):
        print(message["executable"])
'
)
if [[ -z "$test_binary" ]]; then
    echo "gpu-check: cargo did not report the cuda test binary" >&2
    exit 1
fi
echo "cuda test binary: $test_binary"

mkdir -p .gpu
cp target/release/zeroflow .gpu/zeroflow
cp "$test_binary" .gpu/cuda-tests
ls -l .gpu/zeroflow .gpu/cuda-tests
du -sh .gpu
echo "staged in .gpu/; on the GPU machine run: bash scripts/gpu-run.sh (carry: [\".gpu\"])"
