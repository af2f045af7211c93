#!/usr/bin/env bash
# Mutation testing: cargo-mutants (pinned, installed once per machine by
# scripts/cargo-tool.sh) changes the code of the modules .cargo/mutants.toml
# names one mutant at a time and runs the library's unit tests; a mutant
# the tests pass is "missed". Given files (make mutants FILES="a.rs b.rs"),
# only those; given TESTS (make mutants TESTS=domain::), only the unit
# tests whose names contain it judge. Only the library's test binary is
# built for each mutant (--lib as a cargo argument: as a test argument it
# left `cargo test --no-run` building every test target, 25 s a mutant
# instead of about 8). Runs in the working tree (--in-place, so each mutant
# is an incremental build): let it end, or `git checkout` the mutated file.
# Results: target/mutants/mutants.out.
set -euo pipefail
cd "$(dirname "$0")/.."
PATH="$(scripts/cargo-tool.sh cargo-mutants 27.1.0):$PATH"
if [[ -n $(git status --porcelain -- src) ]]; then
  echo "mutants: src/ has uncommitted changes; commit or stash them first" >&2
  exit 2
fi
args=(--in-place --output target/mutants)
if [[ $# -gt 0 ]]; then
  args+=(--no-config --cargo-arg=--lib)
  for file in "$@"; do args+=(--file "$file"); done
fi
if [[ -n ${TESTS:-} ]]; then
  args+=(-- -- "$TESTS")
fi
mkdir -p target/mutants
status=0
cargo mutants "${args[@]}" || status=$?
out=target/mutants/mutants.out
for outcome in caught missed timeout unviable; do
  printf '%-9s %s\n' "$outcome" "$( (cat "$out/$outcome.txt" 2>/dev/null || true) | wc -l)"
done
if [[ -s $out/missed.txt ]]; then
  echo "missed (a change no test noticed):"
  cat "$out/missed.txt"
fi
# cargo mutants exits 2 when a mutant was missed, 3 on a timeout.
exit "$status"
