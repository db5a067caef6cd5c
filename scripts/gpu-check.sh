#!/usr/bin/env bash
# Builds the GPU checks on this machine (no CUDA needed: the libraries are loaded at run time) and
# stages stripped binaries in .gpu/ (ignored by git), for the device tool to carry to the GPU
# machine (it carries at most 64 MiB):
#
#   bash scripts/gpu-check.sh
#   run  command: bash scripts/gpu-run.sh   carry: [".gpu"]   (timeout 600 s or less)
#
# Staged: .gpu/zeroflow (the CLI) and .gpu/tests/<package>, the GPU test binary of each package
# that has one: a test target named `cuda` (or `gpu`) in zeroflow-device (required), zeroflow-nn,
# zeroflow-gpt, zeroflow-llama, zeroflow-engine and zeroflow-train (optional: skipped with a note while they have none).
# scripts/gpu-run.sh is what runs there; it writes its logs under $OUT and prints a table last.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=64
PACKAGES=(zeroflow-device zeroflow-nn zeroflow-gpt zeroflow-llama zeroflow-engine zeroflow-train)

cargo build --release -p zeroflow-cli
# Refuse a binary that cargo kept from another tree built into the same target directory (a
# parent built there from a worktree: a path package's artifacts are named without its location,
# so cargo may call them fresh and not relink this tree's). Its dep-info names the sources it was
# built from. Build a parent in a target directory of its own (CARGO_TARGET_DIR).
if ! grep -qF "$PWD/crates/zeroflow-cli/src/main.rs" target/release/zeroflow.d; then
    echo "gpu-check: target/release/zeroflow was built from another tree ($(head -c 200 \
        target/release/zeroflow.d | cut -d' ' -f2)); run \`cargo clean --release\` and again" >&2
    exit 1
fi

# The GPU test targets, as "package target" lines, from cargo's metadata.
targets=$(
    cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
wanted = set(sys.argv[1:])
for package in json.load(sys.stdin)["packages"]:
    if package["name"] not in wanted:
        continue
    for target in package["targets"]:
        if "test" in target["kind"] and target["name"] in ("cuda", "gpu"):
            print(package["name"], target["name"])
' "${PACKAGES[@]}"
)

rm -rf .gpu/tests .gpu/zeroflow .gpu/cuda-tests
mkdir -p .gpu/tests
# Keeps function names for backtraces, drops the debug info (most of the size).
stage() { # stage SOURCE DESTINATION
    objcopy --strip-debug "$1" "$2" 2>/dev/null || strip --strip-debug -o "$2" "$1"
    chmod +x "$2"
}
stage target/release/zeroflow .gpu/zeroflow

for package in "${PACKAGES[@]}"; do
    target=$(awk -v p="$package" '$1 == p { print $2; exit }' <<<"$targets")
    if [[ -z "$target" ]]; then
        if [[ "$package" == zeroflow-device ]]; then
            echo "gpu-check: zeroflow-device has no \`cuda\` test target" >&2
            exit 1
        fi
        echo "gpu-check: $package has no GPU test target (cuda or gpu): skipped"
        continue
    fi
    # The test binary's path is in cargo's JSON messages (its name carries a hash).
    binary=$(
        cargo test -p "$package" --test "$target" --no-run --release --message-format=json |
            python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message["target"]["name"] == sys.argv[1] \
            and message["profile"]["test"] and message.get("executable"):
        print(message["executable"])
' "$target"
    )
    if [[ -z "$binary" ]]; then
        echo "gpu-check: cargo did not report the $package $target test binary" >&2
        exit 1
    fi
    stage "$binary" ".gpu/tests/$package"
    echo "$package: test target $target -> .gpu/tests/$package"
done

ls -l .gpu/zeroflow .gpu/tests/
total_kib=$(du -sk .gpu | cut -f1)
echo "staged $((total_kib / 1024)) MiB in .gpu/ (the device tool carries at most $LIMIT_MIB MiB)"
if ((total_kib > LIMIT_MIB * 1024)); then
    echo "gpu-check: .gpu is larger than $LIMIT_MIB MiB: strip harder (strip --strip-all)" >&2
    exit 1
fi
echo "on the GPU machine run: bash scripts/gpu-run.sh (carry: [\".gpu\"])"
