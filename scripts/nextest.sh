#!/usr/bin/env bash
# cargo-nextest, the runner `make test` uses (test groups, a per-test
# timeout: .config/nextest.toml), pinned. Uses the one on PATH when it is
# the pin, else installs the pin once per machine (scripts/cargo-tool.sh).
# Prints the directory to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.9.143
if [[ $(cargo nextest --version 2>/dev/null | head -1) == "cargo-nextest $version"* ]]; then
  dirname "$(command -v cargo-nextest)"
  exit 0
fi
exec scripts/cargo-tool.sh cargo-nextest "$version"
