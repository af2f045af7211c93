#!/usr/bin/env bash
# The whole suite (`make test`) RUNS times in a row (default 5) while
# stress-ng keeps one core busy, as a loaded CI machine would; prints each
# run's time and failures, then the failures per test. Logs:
# target/flake-hunt/run-N.log. Exits 1 when any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
out=target/flake-hunt
mkdir -p "$out"
if ! command -v stress-ng >/dev/null; then
  echo "flake-hunt: installing stress-ng (Debian)" >&2
  sudo=; [[ $(id -u) == 0 ]] || sudo=sudo
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng >/dev/null
fi
# Built before the load starts: the runs measure the tests, not the compiler.
cargo build -q --workspace --all-targets
stress-ng --cpu 1 --timeout 0 --quiet &
load=$!
trap 'kill $load 2>/dev/null || true' EXIT
failed_runs=0
: > "$out/failures"
for run in $(seq 1 "$runs"); do
  started=$(date +%s)
  if make test > "$out/run-$run.log" 2>&1; then status=passed; else status=failed; failed_runs=$((failed_runs + 1)); fi
  # nextest's final lines name each failed test: "FAIL [ 1.234s] (n/m) idpool::api module::test".
  grep -E '^\s+(FAIL|TIMEOUT|SIGSEGV|SIGABRT) \[' "$out/run-$run.log" \
    | sed -E 's/.*\) //' | sort -u | tee -a "$out/failures" >/dev/null || true
  summary=$(grep -E '^\s+Summary \[' "$out/run-$run.log" | tail -1 | sed -E 's/^\s+//')
  echo "run $run: $status in $(( $(date +%s) - started )) s; ${summary:-no summary (see $out/run-$run.log)}"
done
echo "failures per test over $runs runs:"
if [[ -s $out/failures ]]; then sort "$out/failures" | uniq -c | sort -rn; else echo "  none"; fi
exit $(( failed_runs > 0 ))
