#!/usr/bin/env bash
# The client tools the tests use, at pinned versions: a Python venv
# (openapi-spec-validator, openapi-python-client, schemathesis, standardwebhooks) and
# node_modules (openapi-typescript, openapi-fetch, typescript). Installed
# once per machine under the tool cache (as scripts/cargo-tool.sh does for
# cargo tools), in a folder named by the pins, and linked into this clone's
# target/sdk (target/sdk/venv and target/sdk/node/node_modules), where the
# tests also keep their work. Two installs of one pin at once wait for each
# other (flock); an install cut off is done again from scratch (the folder
# counts as installed only once it is complete). Needs python3 (with venv)
# and npm; both registries must be reachable the first time.
#
# The cache: $IDPOOL_TOOL_CACHE, else $XDG_CACHE_HOME/idpool/tools, else
# ~/.cache/idpool/tools.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${IDPOOL_TOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/idpool/tools}
pins=$(cat scripts/sdk/requirements.txt scripts/sdk/package.json | sha256sum | cut -c1-12)
root=$cache/sdk-$pins
if [[ ! -f $root/.installed ]]; then
  mkdir -p "$cache"
  exec 9>"$root.lock"
  flock 9
  if [[ ! -f $root/.installed ]]; then
    echo "sdk-tools: installing the pinned Python and npm tools into $root (once per machine)" >&2
    # The venv cannot be moved once made (its scripts name their python):
    # it is made where it stays, and marked installed last.
    rm -rf "$root"
    mkdir -p "$root/node"
    python3 -m venv "$root/venv"
    "$root/venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/sdk/requirements.txt
    cp scripts/sdk/package.json "$root/node/package.json"
    (cd "$root/node" && npm install --no-audit --no-fund --loglevel=error >/dev/null)
    touch "$root/.installed"
  fi
fi

dir=target/sdk
mkdir -p "$dir/node"
# A clone set up before the cache held real folders here.
[[ -L $dir/venv ]] || rm -rf "$dir/venv"
[[ -L $dir/node/node_modules ]] || rm -rf "$dir/node/node_modules"
ln -sfn "$root/venv" "$dir/venv"
ln -sfn "$root/node/node_modules" "$dir/node/node_modules"
cp scripts/sdk/package.json "$dir/node/package.json"
