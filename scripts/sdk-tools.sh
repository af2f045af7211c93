#!/usr/bin/env bash
# Installs the client tools the tests use, at pinned versions, under
# target/sdk: a Python venv (openapi-spec-validator, openapi-python-client,
# schemathesis) and node_modules (openapi-typescript, openapi-fetch,
# typescript). Idempotent: does nothing when the pins are installed.
# Needs python3 (with venv) and npm; both registries must be reachable the
# first time.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/sdk
mkdir -p "$dir"

if ! cmp -s scripts/sdk/requirements.txt "$dir/requirements.installed" 2>/dev/null \
   || [ ! -x "$dir/venv/bin/openapi-python-client" ]; then
  echo "sdk-tools: installing the pinned Python tools into $dir/venv" >&2
  rm -rf "$dir/venv"
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/sdk/requirements.txt
  cp scripts/sdk/requirements.txt "$dir/requirements.installed"
fi

if ! cmp -s scripts/sdk/package.json "$dir/node/package.json" 2>/dev/null \
   || [ ! -x "$dir/node/node_modules/.bin/openapi-typescript" ]; then
  echo "sdk-tools: installing the pinned npm tools into $dir/node" >&2
  rm -rf "$dir/node"
  mkdir -p "$dir/node"
  cp scripts/sdk/package.json "$dir/node/package.json"
  (cd "$dir/node" && npm install --no-audit --no-fund --loglevel=error >/dev/null)
fi
