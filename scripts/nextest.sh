#!/usr/bin/env bash
# cargo-nextest, the runner `make test` uses (test groups, a per-test
# timeout: .config/nextest.toml), pinned. Uses the one on PATH when it is
# the pin, else installs the pin under target/tools (a few minutes, once).
# Prints the directory to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.9.143
root=$PWD/target/tools
if [[ $(cargo nextest --version 2>/dev/null | head -1) == "cargo-nextest $version"* ]]; then
  dirname "$(command -v cargo-nextest)"
  exit 0
fi
if [[ $("$root/bin/cargo-nextest" nextest --version 2>/dev/null | head -1) != "cargo-nextest $version"* ]]; then
  echo "nextest: installing $version into $root (a few minutes, once)" >&2
  cargo install --quiet --locked --root "$root" --version "$version" cargo-nextest >&2
fi
echo "$root/bin"
