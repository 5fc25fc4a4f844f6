#!/usr/bin/env bash
# One command on the GPU machine, from the repository root: GPU tests, compute-sanitizer, benchmarks.
#
#   bash scripts/gpu_check.sh                      # all stages: tests sanitize bench
#   bash scripts/gpu_check.sh tests sanitize       # some stages
#   bash scripts/gpu_check.sh bench_codec train_gnn  # chosen benchmarks (a named one that is missing fails)
#
# Environment: OUT (results folder, default results), BENCH_TIMEOUT (s per benchmark, default 600),
# TIMEOUT_<bench> (per benchmark), ARGS_<bench> (extra arguments, e.g. ARGS_bench_cache="--quick"),
# PYTEST_TIMEOUT (default 900), SANITIZE_TIMEOUT (s per sanitizer run, default 600),
# SANITIZE_TOOLS (default "memcheck racecheck"), SANITIZE_ARGS (extra compute-sanitizer options, e.g.
# "--kernel-regex kns=ibp_" to check only our kernels), TAIL_LINES (log lines shown per stage, default 12).
# Each stage prints PASS/FAIL/SKIP; the script goes on after a failure and exits 1 if any stage failed.
# Output is kept short (full logs are in $OUT); the summary table comes last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-results}
export OUT
mkdir -p "$OUT"
BENCH_TIMEOUT=${BENCH_TIMEOUT:-600}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-900}
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-600}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}
TAIL_LINES=${TAIL_LINES:-12}
BENCHES=(bench_codec bench_cache train_gnn bench_dlrm bench_llm)
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------------------------------------------- stages
do_tests=0 do_sanitize=0 all_benches=0
named_benches=()
[ $# -eq 0 ] && set -- tests sanitize bench
for arg in "$@"; do
  case "$arg" in
    tests) do_tests=1 ;;
    sanitize) do_sanitize=1 ;;
    bench) all_benches=1 ;;
    *)
      if [[ " ${BENCHES[*]} " == *" $arg "* ]]; then
        named_benches+=("$arg")
      else
        echo "gpu_check: unknown stage '$arg' (known: tests sanitize bench ${BENCHES[*]})" >&2
        exit 2
      fi ;;
  esac
done

names=() statuses=() secs=() notes=()
record() {  # record NAME STATUS SECONDS NOTE
  names+=("$1") statuses+=("$2") secs+=("$3") notes+=("$4")
  echo ">>> [$1] $2 (${3}s)${4:+ - $4}"
}
show_tail() {  # the last lines of a log, clipped, so the whole run's output stays small
  tail -n "$TAIL_LINES" "$1" 2>/dev/null | cut -c1-200 | sed 's/^/    /'
}
timeout_note() {  # exit status -> note for timeouts
  case "$1" in 124 | 137) echo "timed out" ;; *) echo "exit $1" ;; esac
}

# ---------------------------------------------------------------------------------------------------- setup
echo "=== setup"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
      >"$OUT/pip_wheels.log" 2>&1; then
    record setup PASS $((SECONDS - t0)) "installed $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
  else
    show_tail "$OUT/pip_wheels.log"
    record setup FAIL $((SECONDS - t0)) "carried wheels did not install (see $OUT/pip_wheels.log)"
  fi
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
else
  record setup SKIP 0 "no .whl/ (run ../shared/tools/stage-gpu-wheels on the dev machine first)"
fi
nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv,noheader 2>&1 | sed 's/^/    gpu: /'
python3 - <<'EOF' 2>&1 | sed 's/^/    /'
import importlib.metadata as md, platform
def v(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"
import torch
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
print(f"python {platform.python_version()} | torch {torch.__version__} (cuda {torch.version.cuda}, {dev})")
names = ["cupy-cuda13x", "numba", "numba-cuda", "dgl", "hydra-core", "transformers", "nvidia-nvcomp-cu13",
         "colossalai", "gguf", "pytest", "hypothesis", "matplotlib"]
print(" | ".join(f"{n} {v(n)}" for n in names))
EOF
command -v compute-sanitizer >/dev/null && compute-sanitizer --version 2>/dev/null | tail -n 1 | sed 's/^/    /'

# ---------------------------------------------------------------------------------------------------- tests
if [ $do_tests -eq 1 ]; then
  echo "=== pytest -m 'gpu or multi_gpu' (log: $OUT/pytest_gpu.log)"
  t0=$SECONDS
  IBPCACHE_REQUIRE_GPU=1 timeout -k 30 "$PYTEST_TIMEOUT" \
    python3 -m pytest -m "gpu or multi_gpu" -x -q >"$OUT/pytest_gpu.log" 2>&1
  rc=$?
  show_tail "$OUT/pytest_gpu.log"
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran" "$OUT/pytest_gpu.log" | tail -n 1 |
    tr -d '=' | xargs)
  case $rc in
    0) record gpu-tests PASS $((SECONDS - t0)) "$summary" ;;
    5) record gpu-tests FAIL $((SECONDS - t0)) "no GPU tests were collected" ;;
    *) record gpu-tests FAIL $((SECONDS - t0)) "$(timeout_note $rc); $summary" ;;
  esac
fi

# ---------------------------------------------------------------------------------------------------- sanitize
if [ $do_sanitize -eq 1 ]; then
  echo "=== compute-sanitizer ($SANITIZE_TOOLS) on scripts/sanitize_*.py"
  shopt -s nullglob
  san_scripts=(scripts/sanitize_*.py)
  shopt -u nullglob
  if [ ${#san_scripts[@]} -eq 0 ]; then
    record sanitize SKIP 0 "no scripts/sanitize_*.py yet"
  elif ! command -v compute-sanitizer >/dev/null; then
    record sanitize FAIL 0 "compute-sanitizer not on PATH"
  else
    for script in "${san_scripts[@]}"; do
      stem=$(basename "$script" .py)
      for tool in $SANITIZE_TOOLS; do
        log="$OUT/${stem}_${tool}.log"
        t0=$SECONDS
        # No caching allocator: torch's pool would hide out-of-bounds accesses inside its own blocks.
        # shellcheck disable=SC2086  # SANITIZE_ARGS is a word list on purpose
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 30 "$SANITIZE_TIMEOUT" \
          compute-sanitizer --tool "$tool" --error-exitcode 86 --target-processes all ${SANITIZE_ARGS:-} \
          python3 "$script" >"$log" 2>&1
        rc=$?
        found=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -n 1 | sed 's/^=* *//')
        if [ $rc -eq 0 ] && ! grep -qE "ERROR SUMMARY: [1-9]|\(([1-9][0-9]*) errors" "$log"; then
          record "$stem:$tool" PASS $((SECONDS - t0)) "${found:-no summary line}"
        else
          show_tail "$log"
          record "$stem:$tool" FAIL $((SECONDS - t0)) "$(timeout_note $rc); ${found:-see $log}"
        fi
      done
    done
  fi
fi

# ---------------------------------------------------------------------------------------------------- benchmarks
run_bench() {  # run_bench NAME REQUIRED(0/1)
  local name=$1 required=$2 script="scripts/$1.py"
  if [ ! -f "$script" ]; then
    if [ "$required" -eq 1 ]; then record "$name" FAIL 0 "$script does not exist"; else record "$name" SKIP 0 "absent"; fi
    return
  fi
  local tvar="TIMEOUT_$name" avar="ARGS_$name"
  local limit=${!tvar:-$BENCH_TIMEOUT} extra=${!avar:-}
  local log="$OUT/$name.log" marker="$OUT/.start_$name" t0=$SECONDS rc
  echo "=== $script $extra (limit ${limit}s, log: $log)"
  touch "$marker"
  # shellcheck disable=SC2086  # ARGS_<name> is a word list on purpose
  timeout -k 30 "$limit" python3 "$script" $extra >"$log" 2>&1
  rc=$?
  show_tail "$log"
  local written
  written=$(find "$OUT" -newer "$marker" \( -name '*.json' -o -name '*.png' \) | wc -l)
  rm -f "$marker"
  if [ $rc -ne 0 ]; then
    record "$name" FAIL $((SECONDS - t0)) "$(timeout_note $rc)"
  elif [ "$written" -eq 0 ]; then
    record "$name" FAIL $((SECONDS - t0)) "exit 0 but no JSON/PNG written to $OUT"
  else
    record "$name" PASS $((SECONDS - t0)) "$written result file(s)"
  fi
}
if [ $all_benches -eq 1 ]; then
  for b in "${BENCHES[@]}"; do run_bench "$b" 0; done
fi
for b in "${named_benches[@]}"; do run_bench "$b" 1; done

# ---------------------------------------------------------------------------------------------------- summary
echo
echo "=== gpu_check summary (results and logs in $OUT)"
failed=0
{
  printf "%-28s %-5s %6s  %s\n" STAGE STATUS SECS NOTE
  for i in "${!names[@]}"; do
    printf "%-28s %-5s %6s  %s\n" "${names[$i]}" "${statuses[$i]}" "${secs[$i]}" "${notes[$i]:0:110}"
  done
} | tee "$OUT/gpu_check_summary.txt"
for st in "${statuses[@]}"; do [ "$st" = FAIL ] && failed=$((failed + 1)); done
python3 - "$OUT/gpu_check_summary.json" "${#names[@]}" "${names[@]}" "${statuses[@]}" "${secs[@]}" "${notes[@]}" <<'EOF'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
cols = [sys.argv[3 + k * n: 3 + (k + 1) * n] for k in range(4)]
stages = [dict(stage=a, status=b, seconds=int(c), note=d) for a, b, c, d in zip(*cols)]
with open(path, "w") as fh:
    json.dump({"stages": stages, "failed": sum(s["status"] == "FAIL" for s in stages)}, fh, indent=1)
EOF
if [ $failed -ne 0 ]; then
  echo "gpu_check: FAILED ($failed stage(s))"
  exit 1
fi
echo "gpu_check: all stages passed or were skipped"
