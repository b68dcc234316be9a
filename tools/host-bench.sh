#!/usr/bin/env bash
# tools/host-bench.sh OUTDIR: the CPU benchmarks on a machine with cores to spare, with the binaries that
# tools/host-carry.sh put in .host-carry/ (for the device tool's GPU machine: 16 cores, no CAF, no ZeroMQ):
#   train_bench --nodes 2 (2 node daemons x 1 replica against 2 replicas in one process; shared memory,
#   TCP, sealed and --insecure) -> allreduce_bench over TCP, sealed and plain, against PyTorch's Gloo ring
#   in the same run (where python3 imports torch) -> train_bench against PyTorch DDP (--torch).
# Each step's output goes to OUTDIR; the figures are printed last. Environment: BUDGET_S (360).
# Exit status: 0 when every step ran and exited 0.
set -u
# The comment above, without its "# ", is the usage text.
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case ${1:-} in
  -h | --help) usage; exit 0 ;;
  "" | -*) { [[ -n ${1:-} ]] && echo "host-bench.sh: unknown option $1" || echo "host-bench.sh: the output folder is missing"; usage; } >&2; exit 2 ;;
esac
(($# == 1)) || { echo "host-bench.sh: one argument, the output folder (see --help)" >&2; exit 2; }
out=$1
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
src=$(cd "$(dirname "$0")/.." && pwd)
carried=$src/.host-carry
budget=${BUDGET_S:-360}
start=$SECONDS
status=0
: > "$out/summary.txt"
[[ -x $carried/bin/train_bench ]] || { echo "no $carried/bin/train_bench: run tools/host-carry.sh first" >&2; exit 2; }
cd "$src" || exit 2  # allreduce_bench finds tools/gloo_allreduce.py from here

# Our binaries (and the node daemons train_bench starts) see the carried libraries; python and torch keep
# their own, through a python3 that puts back the machine's own LD_LIBRARY_PATH. (The benchmarks fall back
# to /usr/bin/python3 only when the python3 on PATH has no torch.)
real_python=$(command -v python3 || true)
if [[ -n $real_python ]]; then
  mkdir -p "$out/shim"
  if [[ -n ${LD_LIBRARY_PATH:-} ]]; then restore="export LD_LIBRARY_PATH=$(printf %q "$LD_LIBRARY_PATH")"; else restore="unset LD_LIBRARY_PATH"; fi
  printf '#!/usr/bin/env bash\n%s\nexec %q "$@"\n' "$restore" "$real_python" > "$out/shim/python3"
  chmod +x "$out/shim/python3"
  export PATH=$out/shim:$PATH
fi
export LD_LIBRARY_PATH=$carried/lib
# Libraries the carried binaries cannot find here (an older glibc than Debian 12's, say).
for b in "$carried"/bin/*; do ldd "$b" 2>&1 | grep "not found" | sed "s|^|$(basename "$b"): |"; done > "$out/ldd_missing.txt"
[[ -s $out/ldd_missing.txt ]] && { echo "MISSING LIBRARIES:"; cat "$out/ldd_missing.txt"; } | tee -a "$out/summary.txt"
export HOME=$out/home  # keys are made on first use: a fresh home, nothing of the machine's touched
mkdir -p "$HOME"
{
  echo "cores: $(nproc), AVX-512: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no)"
  lscpu 2>/dev/null | grep -E "Model name|Socket|Thread|NUMA node\(s\)"
} > "$out/env.txt"

# step NAME LIMIT COMMAND...: runs COMMAND under timeout, never past the overall budget.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    echo "$name: not run (out of time)" >> "$out/summary.txt"
    status=1
    return
  fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  ((rc != 0)) && status=1
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" >> "$out/summary.txt"
}

bin=$carried/bin
step train_bench_nodes 150 "$bin/train_bench" --nodes 2 --repeat 3 --node-bin "$bin/ringmaster-node" --data "$carried/data"
step allreduce_tcp_sealed 60 "$bin/allreduce_bench" --transport tcp --sizes 4K,1M,64M --compare gloo
step allreduce_tcp_plain 60 "$bin/allreduce_bench" --transport tcp --security none --sizes 4K,1M,64M --compare gloo
step train_bench_torch 90 "$bin/train_bench" --torch --repeat 3

cat "$out/env.txt" "$out/summary.txt"
for f in "$out"/*.txt; do
  case $(basename "$f") in env.txt | summary.txt | ldd_missing.txt) continue ;; esac
  echo "== $(basename "$f" .txt)"
  grep -v '^#   ' "$f" | tail -n 14
done
exit $status
