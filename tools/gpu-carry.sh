#!/usr/bin/env bash
# tools/gpu-carry.sh: prepares .gpu-carry/ (git-ignored) for a session's GPU machine, whose image has
# CUDA, CMake and PyTorch but none of our Debian libraries (CAF, ZeroMQ, Boost...) and no network.
# Builds the GPU tests, gpu_bench and ringmaster-mnist here (sm_90 + PTX, without OpenBLAS to stay small),
# and copies them with the shared libraries they need, CUDA's and glibc's excepted (the GPU machine has
# its own), and the Fashion-MNIST files (30 MB) for a real training run there.
# Then, with the device tool: run(command="tools/gpu-check.sh $OUT/gpu", carry=[".gpu-carry"]);
# gpu-check.sh uses the carried binaries when the machine cannot build.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=$src/build-gpu-carry
dest=$src/.gpu-carry
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRINGMASTER_CUDA=ON -DRINGMASTER_OPENBLAS=OFF \
      -DRINGMASTER_NATIVE=OFF > /dev/null
cmake --build "$build" -j2 --target ringmaster_cuda_tests gpu_bench ringmaster-mnist
rm -rf "$dest" && mkdir -p "$dest/bin" "$dest/lib" "$dest/data"
cp "$build/tests/ringmaster_cuda_tests" "$build/gpu_bench" "$build/ringmaster-mnist" "$dest/bin/"
cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$dest/data/"
for bin in "$dest"/bin/*; do
  ldd "$bin" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|librt|libpthread|libresolv|ld-linux[^/]*|libcuda|libcudart|libcublas[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
grep -qx '/.gpu-carry/' "$src/.git/info/exclude" 2>/dev/null || echo '/.gpu-carry/' >> "$src/.git/info/exclude"
du -sh "$dest"
ls "$dest/lib"
