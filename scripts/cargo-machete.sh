#!/usr/bin/env bash
# Installs cargo-machete (dependencies Cargo.toml names that no source file
# uses), pinned, under target/tools. Idempotent: does nothing when the pin
# is installed. Prints the directory to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.9.2
root=$PWD/target/tools
if [[ $("$root/bin/cargo-machete" --version 2>/dev/null) != *"$version"* ]]; then
  echo "cargo-machete: installing $version into $root (about a minute, once)" >&2
  cargo install --quiet --locked --root "$root" --version "$version" cargo-machete >&2
fi
echo "$root/bin"
