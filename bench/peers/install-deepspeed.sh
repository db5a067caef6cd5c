#!/usr/bin/env bash
# Installs the peers' Python packages and DeepSpeed 0.19.8 from .peers/ (what fetch-wheels.sh
# downloaded; the GPU machine has no network) into /tmp/site, without building DeepSpeed's ops
# (they are built just in time). Does nothing if /tmp/site already has DeepSpeed. Run from the
# repository root, then `export PYTHONPATH=/tmp/site`:
#
#   bash bench/peers/install-deepspeed.sh
set -uo pipefail
[[ -d /tmp/site/deepspeed ]] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/wheels/*.whl >/dev/null 2>&1
mkdir -p /tmp/ds && tar -xzf .peers/deepspeed-0.19.8.tar.gz -C /tmp/ds
(cd /tmp/ds/deepspeed-0.19.8 && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps \
    --no-build-isolation --target /tmp/site . >/dev/null 2>&1)
[[ -d /tmp/site/deepspeed ]] || { echo "install-deepspeed: DeepSpeed did not install into /tmp/site" >&2; exit 1; }
