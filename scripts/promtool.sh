#!/usr/bin/env bash
# Installs promtool (to check and unit-test deploy/prometheus/) under
# target/tools/prometheus, from Debian's `prometheus` package, pinned;
# unpacked only, nothing installed system-wide, no service started.
# Idempotent. Prints the path of promtool.
set -euo pipefail
cd "$(dirname "$0")/.."
version=2.42.0+ds-5+deb12u1
dir=$PWD/target/tools/prometheus
promtool=$dir/usr/bin/promtool
if [[ ! -x $promtool || $(cat "$dir/version" 2>/dev/null) != "$version" ]]; then
  echo "promtool: unpacking Debian's prometheus $version into $dir" >&2
  rm -rf "$dir" && mkdir -p "$dir/deb"
  (cd "$dir/deb" && apt-get download -q "prometheus=$version" >&2 2>/dev/null \
    || { apt-get update -q >&2 && apt-get download -q "prometheus=$version" >&2; })
  dpkg-deb -x "$dir"/deb/prometheus_*.deb "$dir"
  rm -rf "$dir/deb"
  echo "$version" >"$dir/version"
fi
echo "$promtool"
