#!/usr/bin/env bash
# cargo-machete (dependencies Cargo.toml names that no source file uses),
# pinned; installed once per machine by scripts/cargo-tool.sh. Prints the
# directory to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
exec scripts/cargo-tool.sh cargo-machete 0.9.2
