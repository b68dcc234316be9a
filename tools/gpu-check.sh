#!/usr/bin/env bash
# tools/gpu-check.sh OUTDIR: everything a GPU machine should check, in one go, within 5 minutes:
#   configure (Release, RINGMASTER_CUDA=ON) -> build -j16 -> ctest (the GPU tests must run, not skip)
#   -> gpu_bench (the MLPs and the Keras convnet "cnn") -> ringmaster-mnist on the GPU (the MLP on 1
#   replica, then 2 sharing it, then the cnn; Fashion-MNIST from /usr/share/datasets or from
#   .gpu-carry/data) -> tools/torch_bench.py (the same models in PyTorch eager, where torch sees the GPU)
#   -> a short table, printed last, with ringmaster / PyTorch ratios.
# Full logs go to OUTDIR (summary.txt lists every step with its exit status and time).
# Environment: BUILD_DIR (default <repo>/build-gpu), JOBS (16), BUDGET_S (290, for all steps together).
# Exit status: 0 when the build, every test (GPU tests included) and the benchmark passed.
set -u
# The comment above, without its "# ", is the usage text.
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case ${1:-} in
  -h | --help) usage; exit 0 ;;
  "" | -*) { [[ -n ${1:-} ]] && echo "gpu-check.sh: unknown option $1" || echo "gpu-check.sh: the output folder is missing"; usage; } >&2; exit 2 ;;
esac
(($# == 1)) || { echo "gpu-check.sh: one argument, the output folder (see --help)" >&2; exit 2; }
out=$1
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
src=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$src/build-gpu}
jobs=${JOBS:-16}
budget=${BUDGET_S:-290}
start=$SECONDS
status=0
: > "$out/summary.txt"
# nvcc is often installed but not on PATH; CMake honours CUDACXX.
if ! command -v nvcc > /dev/null && [[ -x /usr/local/cuda/bin/nvcc && -z ${CUDACXX:-} ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

# step NAME LIMIT LOG COMMAND...: runs COMMAND under timeout, never past the overall budget.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((budget - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    echo "$name: not run (out of time)" >> "$out/summary.txt"
    return 124
  fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s), log $(basename "$log")" >> "$out/summary.txt"
  return $rc
}

{
  echo "== nvidia-smi"; nvidia-smi 2>&1 || true
  echo "== nvcc"; (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 || true
  echo "== cmake"; cmake --version 2>&1 | head -1
  echo "== git"; git -C "$src" log --oneline -1 2>&1; git -C "$src" status --short 2>&1 | head -20
} > "$out/env.txt" 2>&1

built=no
ctest_line="not run"
gpu_tests="not run"
carried=$src/.gpu-carry
if [[ ! -f /usr/include/caf/config.hpp && -x $carried/bin/ringmaster_cuda_tests ]]; then
  # No CAF here to build with: run what tools/gpu-carry.sh built on a build machine. Only our binaries
  # see the carried libraries (python and torch keep their own libstdc++).
  run_carried=(env "LD_LIBRARY_PATH=$carried/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}")
  echo "build: carried from tools/gpu-carry.sh ($(ls "$carried/bin" | tr '\n' ' '))" >> "$out/summary.txt"
  # Libraries the carried binaries cannot find here (libcudart / libcublas 13 must come from this machine).
  for bin in "$carried"/bin/*; do "${run_carried[@]}" ldd "$bin" 2>&1 | grep "not found" | sed "s|^|$(basename "$bin"): |"; done \
    > "$out/ldd_missing.txt"
  [[ -s $out/ldd_missing.txt ]] && { echo "MISSING LIBRARIES:"; cat "$out/ldd_missing.txt"; } | tee -a "$out/summary.txt"
  ctest_line="carried binaries, no ctest"
  if step gpu_tests 100 "$out/ctest-LastTest.log" "${run_carried[@]}" "$carried/bin/ringmaster_cuda_tests"; then
    gpu_tests="passed"
  else
    rc=$?
    gpu_tests="FAILED or skipped (exit $rc, see ctest-LastTest.log)"
    status=1
  fi
  step gpu_bench 100 "$out/gpu_bench.log" "${run_carried[@]}" "$carried/bin/gpu_bench" 1.5 || status=1
  mnist=("${run_carried[@]}" "$carried/bin/ringmaster-mnist")
  built=carried
elif step configure 60 "$out/configure.log" \
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRINGMASTER_CUDA=ON; then
  if step build 170 "$out/build.log" cmake --build "$build" -j "$jobs"; then
    built=yes
  else
    status=1
  fi
else
  status=1
fi

if [[ $built == yes ]]; then
  step ctest 120 "$out/ctest.log" ctest --test-dir "$build" -j 8 --output-on-failure || status=1
  # LastTest.log holds every test's full output, passing ones too (the GPU tests' WARN lines with the
  # measured GPU-vs-CPU differences are there).
  cp "$build/Testing/Temporary/LastTest.log" "$out/ctest-LastTest.log" 2>/dev/null || true
  ctest_line=$(grep -E "tests passed|tests failed" "$out/ctest.log" | tail -1)
  if grep -qE "ringmaster_cuda_tests \.+ *Passed" "$out/ctest.log"; then
    gpu_tests="passed"
  elif grep -qE "ringmaster_cuda_tests \.+\*+Skipped" "$out/ctest.log"; then
    gpu_tests="SKIPPED: the tests saw no GPU (see ctest-LastTest.log)"
    status=1
  else
    gpu_tests="FAILED or did not finish (see ctest.log)"
    status=1
  fi
  step gpu_bench 100 "$out/gpu_bench.log" "$build/gpu_bench" 1.5 || status=1
  mnist=("$build/ringmaster-mnist")
fi

# The launcher on the GPU, real data, defaults but the device: 1 replica, then 2 replicas sharing GPU 0;
# then the Keras convnet on 1 replica for 2 epochs.
data=/usr/share/datasets/fashion-mnist
[[ -f $data/train-labels-idx1-ubyte.gz || -f $data/train-labels-idx1-ubyte ]] || data=$src/.gpu-carry/data
mnist_rows=()
if [[ -n ${mnist:-} && -x ${mnist[-1]} ]]; then
  for run in "cuda:0 784-512-512-10 5" "cuda:0,0 784-512-512-10 5" "cuda:0 cnn 2"; do
    read -r dev model epochs <<< "$run"
    tag=${dev//[:,]/_}
    [[ $model == cnn ]] && tag=${tag}_cnn
    what="mnist --device $dev --model $model --epochs $epochs"
    step "mnist $dev $model" 40 "$out/mnist_$tag.log" "${mnist[@]}" --data "$data" --device "$dev" --model "$model" \
        --epochs "$epochs" --report-json "$out/mnist_$tag.json"
    rc=$?
    if ((rc == 0)); then
      mnist_rows+=("$what: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("test accuracy %.4f, %.0f samples/s, %.1f s wall" % (r["test_accuracy"], r["train_samples_per_sec"], r["wall_seconds"]))' "$out/mnist_$tag.json" 2>&1)")
    elif [[ ! -f $out/mnist_$tag.log ]]; then
      mnist_rows+=("$what: not run (out of time)")
    else
      reason="exit $rc"
      ((rc == 124)) && reason="out of time"
      mnist_rows+=("$what: FAILED ($reason, see mnist_$tag.log)")
      status=1
    fi
  done
fi

torch_note=""
if step torch_import 30 "$out/torch_import.log" python3 -c "import torch"; then
  step torch_bench 60 "$out/torch_bench.log" python3 "$src/tools/torch_bench.py" 1.5
  rc=$?
  ((rc == 77)) && torch_note="torch: $(head -1 "$out/torch_bench.log")"
  ((rc != 0 && rc != 77)) && torch_note="torch_bench failed (exit $rc), see torch_bench.log"
else
  torch_note="torch: not importable here (python3 -c 'import torch' failed), no PyTorch figures"
fi

# ---- the short table, last -----------------------------------------------------------------------
{
  echo
  echo "== ringmaster GPU check ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))," \
       "$((SECONDS - start)) s"
  echo "build: $built; ctest: ${ctest_line:-no summary}; GPU tests: $gpu_tests"
  grep -hE "GPU vs CPU from the same parameters|GPU replicas vs 2 CPU|col2im differs" "$out/ctest-LastTest.log" 2>/dev/null |
    sed 's/^[[:space:]]*/  /' | sort -u
  echo
  logs=()
  for f in "$out/gpu_bench.log" "$out/torch_bench.log"; do [[ -f $f ]] && logs+=("$f"); done
  ((${#logs[@]})) || logs=(/dev/null)
  awk '
    $1 == "RESULT" && $2 == "train" { key = $3 " " $4; keys[++n] = key; dev[key] = $5; staged[key] = $6 }
    $1 == "RESULT" && $2 == "torch" { key = $3 " " $4; tasync[key] = $5; titem[key] = $6 }
    $1 == "RESULT" && $2 == "add" { add = sprintf("add_inplace 64 MB: %s GB/s = %s of cudaMemcpy D2D (%s GB/s), wrong results %s", $3, $5, $4, $6) }
    $1 == "RESULT" && $2 == "ring" { ring = sprintf("ring all-reduce, 2 reducers on one GPU, 64 MB: %s us, busbw %s GB/s, wrong results %s", $3, $4, $5) }
    $1 == "RESULT" && $2 == "job" { jobs[++nj] = sprintf("%-16s %6s %13s %13s", $3, $4, $5, $6) }
    END {
      if (n == 0) { print "no benchmark results (see gpu_bench.log)"; exit }
      printf "%-16s %6s %13s %13s %13s %13s %9s %9s\n", "samples/s", "batch", "rm device", "rm staged", "torch async", \
        "torch item", "dev/async", "stg/item"
      for (i = 1; i <= n; i++) {
        k = keys[i]; split(k, p, " ")
        r1 = (k in tasync) && tasync[k] > 0 ? sprintf("%.2fx", dev[k] / tasync[k]) : "-"
        r2 = (k in titem) && titem[k] > 0 ? sprintf("%.2fx", staged[k] / titem[k]) : "-"
        printf "%-16s %6s %13s %13s %13s %13s %9s %9s\n", p[1], p[2], dev[k], staged[k], \
          (k in tasync) ? tasync[k] : "-", (k in titem) ? titem[k] : "-", r1, r2
      }
      if (add != "") print add
      if (ring != "") print ring
      if (nj) { printf "%-16s %6s %13s %13s\n", "whole job s/s", "batch", "1 x cuda:0", "2 x cuda:0"; for (i = 1; i <= nj; i++) print jobs[i] }
    }' "${logs[@]}"
  for row in "${mnist_rows[@]}"; do echo "$row"; done
  [[ -n $torch_note ]] && echo "$torch_note"
  echo "rm device: batches already on the GPU; rm staged: plus the replica's per-step copy of its batch" \
       "from the host. dev/async, stg/item: ringmaster over PyTorch eager (target for the cnn: 2x or more)." \
       "whole job: ringmaster::train() with loaders, replicas, reducers, coordinator."
  echo "overall: $([[ $status == 0 ]] && echo OK || echo FAILED) (logs in $out)"
} | tee "$out/table.txt"
exit $status
