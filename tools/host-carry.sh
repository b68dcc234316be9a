#!/usr/bin/env bash
# tools/host-carry.sh: prepares .host-carry/ (git-ignored) so that the CPU benchmarks can run on a machine
# with more cores than this one but none of our Debian libraries (the device tool's GPU machine: 16 cores,
# CUDA and PyTorch, no CAF, no ZeroMQ, no network). Our own machines have 2 cores, where two node processes
# and their I/O threads fight for them; this shows what the same code does when each has a core to spare.
# Builds train_bench, ringmaster-node and allreduce_bench for x86-64-v3 (AVX2 + FMA, which any server of
# the last decade has; -march=native would tie them to this CPU) without OpenBLAS (36 MB; the dense layers
# then use Eigen's GEMM), and copies them with the shared libraries they need, glibc's excepted, and the
# Fashion-MNIST files. They need the other machine's glibc to be 2.36 (Debian 12's) or newer. Then, with
# the device tool:
#   run(command="tools/host-bench.sh $OUT/host", carry=[".host-carry"])
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=$src/build-host-carry
dest=$src/.host-carry
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRINGMASTER_NATIVE=OFF -DRINGMASTER_OPENBLAS=OFF \
      -DRINGMASTER_TESTS=OFF -DRINGMASTER_CUDA=OFF -DCMAKE_CXX_FLAGS=-march=x86-64-v3 > /dev/null
cmake --build "$build" -j2 --target train_bench ringmaster-node allreduce_bench
rm -rf "$dest" && mkdir -p "$dest/bin" "$dest/lib" "$dest/data"
cp "$build/train_bench" "$build/ringmaster-node" "$build/allreduce_bench" "$dest/bin/"
strip "$dest"/bin/*
cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$dest/data/"
for bin in "$dest"/bin/*; do
  ldd "$bin" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|librt|libpthread|libresolv|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
du -sh "$dest"
ls "$dest/lib"
