#!/usr/bin/env bash
# Installs promtool (to check and unit-test deploy/prometheus/) from
# Debian's `prometheus` package, pinned, once per machine under the tool
# cache (as scripts/cargo-tool.sh does): unpacked only, nothing installed
# system-wide, no service started. A promtool on PATH of the pinned version
# is used as it is. Prints the path of promtool.
set -euo pipefail
cd "$(dirname "$0")/.."
version=2.42.0+ds-5+deb12u1
if on_path=$(command -v promtool) && "$on_path" --version 2>&1 | grep -q "version ${version%%+*} "; then
  echo "$on_path"
  exit 0
fi
cache=${IDPOOL_TOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/idpool/tools}
dir=$cache/prometheus-$version
promtool=$dir/usr/bin/promtool
if [[ ! -f $dir/.installed ]]; then
  mkdir -p "$cache"
  exec 9>"$dir.lock"
  flock 9
  if [[ ! -f $dir/.installed ]]; then
    echo "promtool: unpacking Debian's prometheus $version into $dir (once per machine)" >&2
    rm -rf "$dir" && mkdir -p "$dir/deb"
    (cd "$dir/deb" && apt-get download -q "prometheus=$version" >&2 2>/dev/null \
      || { apt-get update -q >&2 && apt-get download -q "prometheus=$version" >&2; })
    dpkg-deb -x "$dir"/deb/prometheus_*.deb "$dir"
    rm -rf "$dir/deb"
    touch "$dir/.installed"
  fi
fi
echo "$promtool"
