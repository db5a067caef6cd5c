#!/usr/bin/env bash
# One device call (issue 23, point 3): the exact offload step overlapped with the next forward
# (ZEROFLOW_OVERLAP_FORWARD=on, the default) against the step done before it (off), with the
# binary scripts/gpu-check.sh staged: scripts/setting-ab.sh with that variable (its exactness and
# speed parts, and their environment: PARTS, SPEED_MODELS, ROUNDS, STEPS, WARMUP, ACCUM).
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/overlap-forward.sh   carry: [".gpu"]
VAR=ZEROFLOW_OVERLAP_FORWARD VALUES=${VALUES:-on off} exec bash "$(dirname "$0")/setting-ab.sh"
