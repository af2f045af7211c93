#!/usr/bin/env bash
# Installs sqlx-cli (`cargo sqlx prepare`), pinned to the sqlx of
# Cargo.toml, under target/tools; Postgres support only, no TLS (it talks to
# the local database). Idempotent: does nothing when the pin is installed.
# Prints the directory to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.9.0
root=$PWD/target/tools
if [[ $("$root/bin/sqlx" --version 2>/dev/null) != "sqlx-cli $version" ]]; then
  echo "sqlx-cli: installing $version into $root (about 3 minutes, once)" >&2
  cargo install --quiet --locked --root "$root" --version "$version" \
    --no-default-features --features postgres sqlx-cli >&2
fi
echo "$root/bin"
