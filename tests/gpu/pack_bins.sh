#!/usr/bin/env bash
# pack_bins.sh [EXTRA...] - for device calls: the GPU test and bench binaries
# (and build/old_bench_gpu, a last round's bench, when present) stripped and
# packed into .carry/bin.tar.xz (~2 MB: the binaries share one fatbin, which
# a 256 MiB xz dictionary stores once; unpacked they are ~150 MB, over the
# 64 MiB a call carries). There: python3 -c "import tarfile;
# tarfile.open('.carry/bin.tar.xz').extractall('.')". The default model
# (98 MB, 90 MB as xz) travels in two calls: tests/gpu/engine27_run.sh.
set -e
cd "$(dirname "$0")/../.."
t=$(mktemp -d)
for f in build/sluice build/tests/test_engine build/tests/gpu/* build/old_bench_gpu "$@"; do
    [ -f "$f" ] || continue
    mkdir -p "$t/$(dirname "$f")"
    strip -o "$t/$f" "$f"
done
mkdir -p .carry
tar -C "$t" -cf - build | xz -T2 --lzma2=preset=6,dict=256MiB >.carry/bin.tar.xz
rm -rf "$t"
ls -la .carry/bin.tar.xz
