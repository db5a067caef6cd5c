#!/usr/bin/env bash
# Downloads, here (where pip reaches PyPI), what the DeepSpeed peer needs on the GPU machine, which
# has no network: the deepspeed 0.19.8 source archive and the wheels (Python 3.12, manylinux
# x86_64) of its requirements that the machine's image lacks. Everything lands in the git-ignored
# folder .peers/ at the repository's root; carry ".peers" in the device call.
#
# deepspeed's requirements.txt: einops hjson msgpack ninja numpy packaging psutil py-cpuinfo
# pydantic>=2 torch tqdm. The image already has einops, msgpack, ninja, numpy, packaging, psutil,
# py-cpuinfo, torch, tqdm and typing-extensions; hjson and pydantic (with pydantic-core,
# annotated-types, typing-inspection) are missing. py-cpuinfo and typing-extensions are fetched
# too (small, and deepspeed imports both) so that the set does not depend on the image's versions.
#
# Usage: bench/peers/fetch-wheels.sh   (then see bench/peers/README.md)
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.peers"
mkdir -p "$dest/wheels"

pip=(python3 -m pip download --disable-pip-version-check --quiet)

# The source archive (deepspeed publishes no wheel); its own dependencies are listed below.
"${pip[@]}" --no-deps --no-binary=:all: --dest "$dest" "deepspeed==0.19.8"

# Wheels for the GPU machine's interpreter, resolved together so that pydantic and pydantic-core
# match. pip matches manylinux tags exactly, hence the list.
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$tag")
done
"${pip[@]}" --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    --dest "$dest/wheels" \
    hjson "pydantic>=2,<3" py-cpuinfo typing-extensions

echo "fetched into $dest:"
ls -1 "$dest" "$dest/wheels"
du -sh "$dest"
