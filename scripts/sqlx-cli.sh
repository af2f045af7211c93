#!/usr/bin/env bash
# sqlx-cli (`cargo sqlx prepare`), pinned to the sqlx of Cargo.toml;
# Postgres support only, no TLS (it talks to the local database). Installed
# once per machine by scripts/cargo-tool.sh. Prints the directory to put on
# PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
exec scripts/cargo-tool.sh sqlx-cli 0.9.0 --no-default-features --features postgres
