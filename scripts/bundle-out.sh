#!/usr/bin/env bash
# Packs the small files under $OUT (logs, JSON lines, metrics, plots: each under 8 MiB, no
# checkpoints) into $OUT/00-results.tgz, so that one device call brings all of them back: the device
# tool returns only a limited number of files per call, in name order, and this one sorts first.
# The GPU scripts call it last; running it again replaces the bundle.
#
#   bash scripts/bundle-out.sh            (OUT defaults to .gpu/out)
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
[[ -d "$OUT" ]] || exit 0
bundle=$OUT/00-results.tgz
(cd "$OUT" && find . -type f -size -8M ! -name 00-results.tgz ! -name '*.safetensors' -print0 |
    tar -czf "$bundle.tmp" --null -T -) && mv "$bundle.tmp" "$bundle"
echo "bundled $(tar -tzf "$bundle" | wc -l) files into $bundle"
