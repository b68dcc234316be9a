#!/usr/bin/env bash
# tools/fuzz.sh: builds the libFuzzer harnesses of tests/fuzz with clang++ (ASan + UBSan) and fuzzes
# them; prints executions, exec/s and crashes per harness; exit 1 on any crash, whose input it keeps.
# The fuzz_smoke test runs it briefly (tests/CMakeLists.txt). Run with --help for the options.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
all=(frames job idx safetensors checkpoint sealed)

usage() {
  cat << EOF
Usage: tools/fuzz.sh [--runs N] [--seconds S] [--build-dir DIR] [--crashes DIR] [--cxx CLANG] [HARNESS...]

Builds the libFuzzer harnesses (tests/fuzz) with clang++ under AddressSanitizer and
UndefinedBehaviorSanitizer, then fuzzes each in turn. Harnesses (default: all):
  frames       a received multipart message as the bridge checks it, and key=value payloads (net/wire)
  job          a job plan's JSON from the network (actors/job_plan: from_json, validate)
  idx          IDX data files, raw and gzip-compressed (kernels/dataset: read_idx_bytes)
  safetensors  weights files for two small models (kernels/safetensors: read_safetensors_bytes)
  checkpoint   checkpoint files as --resume reads them (actors/checkpoint: read_checkpoint)
  sealed       sealed ring chunks: round trips, flipped bits, replays, strangers' messages (net/seal)

Options:
  --runs N         fuzzed inputs per harness (default 1000000)
  --seconds S      stop a harness after S seconds, even short of --runs (default: no limit)
  --build-dir DIR  where the harnesses are built and each one's corpus grows (default build/fuzz)
  --crashes DIR    where the inputs that crash are kept (default BUILD_DIR/crashes)
  --cxx CLANG      the clang++ to build with (default clang++)
  -h, --help       this text

Prints one line per harness: inputs run, seconds, exec/s, crashes, corpus size and coverage. A
harness stops at its first crash (a sanitizer report, a broken property, a timeout of 10 s or more
than 2 GB); its input is kept as CRASHES/NAME-crash-<sha1>, and BUILD_DIR/fuzz_NAME FILE runs it
again. Exit status: 0 no crash, 1 a crash, 2 a usage or build error (e.g. no clang++ or libFuzzer:
on Debian, apt-get install clang libclang-rt-14-dev).
EOF
}

die() {
  echo "fuzz.sh: $*" >&2
  exit 2
}

runs=1000000 seconds=0 build=$src/build/fuzz crashes="" cxx=clang++
names=()
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --runs | --seconds | --build-dir | --crashes | --cxx)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      case $1 in
        --runs) runs=$2 ;;
        --seconds) seconds=$2 ;;
        --build-dir) build=$2 ;;
        --crashes) crashes=$2 ;;
        --cxx) cxx=$2 ;;
      esac
      shift 2 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *)
      [[ " ${all[*]} " == *" $1 "* ]] || die "unknown harness '$1' (known: ${all[*]})"
      names+=("$1")
      shift ;;
  esac
done
[[ $runs =~ ^[1-9][0-9]{0,11}$ ]] || die "--runs takes a positive whole number, not '$runs'"
[[ $seconds =~ ^[0-9]{1,9}$ ]] || die "--seconds takes a whole number of seconds, not '$seconds'"
((${#names[@]})) || names=("${all[@]}")
command -v "$cxx" > /dev/null ||
  die "no $cxx: the harnesses need clang++ and libFuzzer (Debian: apt-get install clang libclang-rt-14-dev)"
mkdir -p "$build"
build=$(cd "$build" && pwd)
crashes=${crashes:-$build/crashes}
mkdir -p "$crashes" "$build/logs"
crashes=$(cd "$crashes" && pwd)

# Build (quietly; the log is shown when it fails), then write the seed inputs.
echo "fuzz.sh: building the harnesses with $cxx in $build"
if ! { cmake -S "$src/tests/fuzz" -B "$build" -DCMAKE_CXX_COMPILER="$cxx" &&
  cmake --build "$build" -j2; } > "$build/logs/build.log" 2>&1; then
  tail -n 30 "$build/logs/build.log" >&2
  die "building the harnesses failed (log: $build/logs/build.log)"
fi
rm -rf "$build/seeds"
"$build/fuzz_seeds" "$build/seeds" || die "fuzz_seeds could not write the seed inputs"

# stat NAME LOG: a value from libFuzzer's final statistics (-print_final_stats=1), or "?".
final_stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -n 1 | grep . || echo "?"; }

failed=()
printf '%-12s %10s %8s %9s %8s %7s %6s\n' harness runs seconds exec/s crashes corpus cov
for name in "${names[@]}"; do
  corpus=$build/corpus/$name
  log=$build/logs/$name.log
  mkdir -p "$corpus"
  args=(-runs="$runs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$crashes/$name-")
  ((seconds > 0)) && args+=(-max_total_time="$seconds")
  [[ -f $src/tests/fuzz/$name.dict ]] && args+=(-dict="$src/tests/fuzz/$name.dict")
  start=$EPOCHREALTIME
  status=0
  "$build/fuzz_$name" "${args[@]}" "$corpus" "$build/seeds/$name" > "$log" 2>&1 || status=$?
  elapsed=$(awk "BEGIN { print $EPOCHREALTIME - $start }")
  executed=$(final_stat number_of_executed_units "$log")
  rate=$(awk -v n="$executed" -v t="$elapsed" 'BEGIN { if (n ~ /^[0-9]+$/ && t > 0) printf "%.0f", n / t; else print "?" }')
  cov=$(sed -n 's/.* cov: \([0-9]*\) .*/\1/p' "$log" | tail -n 1 | grep . || echo "?")
  found=0
  if ((status != 0)); then
    found=1
    failed+=("$name")
  fi
  printf '%-12s %10s %8.1f %9s %8s %7s %6s\n' "$name" "$executed" "$elapsed" "$rate" "$found" \
    "$(find "$corpus" -type f | wc -l)" "$cov"
done

if ((${#failed[@]})); then
  for name in "${failed[@]}"; do
    log=$build/logs/$name.log
    echo
    echo "== $name crashed (exit status of the harness: see $log); what the harness said:"
    grep -m 1 -A 25 -E '^==[0-9]+==ERROR|runtime error|fuzz property failed|ERROR: libFuzzer' "$log" || tail -n 25 "$log"
    for unit in $(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log"); do
      echo "input kept: $unit   (run it again: $build/fuzz_$name $unit)"
    done
  done
  echo
  echo "fuzz.sh: ${#failed[@]} of ${#names[@]} harnesses crashed; inputs in $crashes"
  exit 1
fi
echo "fuzz.sh: no crashes in ${#names[@]} harnesses (corpus in $build/corpus, crashes would go to $crashes)"
