#!/usr/bin/env bash
# A pinned cargo tool, installed once per machine and reused by every clone:
#   scripts/cargo-tool.sh CRATE VERSION [cargo install flags...]
# installs CRATE at VERSION (with the flags, e.g. features) into a folder of
# its own under the tool cache, named by crate, version and flags, and prints
# that folder's bin/ to put on PATH. A clean clone thus builds no tool a
# previous clone on the machine already built (CI's clean clones took about
# six minutes for them). Two installs of one pin at once wait for each other
# (flock); an install that fails or is cut off leaves nothing behind, since
# the folder only gets its name once the install is complete.
#
# The cache: $IDPOOL_TOOL_CACHE, else $XDG_CACHE_HOME/idpool/tools, else
# ~/.cache/idpool/tools. Removing it costs one rebuild of each tool.
set -euo pipefail
crate=$1
version=$2
shift 2
cache=${IDPOOL_TOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/idpool/tools}
flags=$*
suffix=""
if [[ -n $flags ]]; then
  suffix=-$(printf '%s' "$flags" | sha256sum | cut -c1-12)
fi
root=$cache/$crate-$version$suffix
if [[ ! -f $root/.installed ]]; then
  mkdir -p "$cache"
  exec 9>"$root.lock"
  flock 9
  if [[ ! -f $root/.installed ]]; then
    echo "$crate: installing $version into $root (once per machine)" >&2
    staging=$(mktemp -d "$root.XXXXXX")
    trap 'rm -rf "$staging"' EXIT
    cargo install --quiet --locked --root "$staging" --version "$version" "$@" "$crate" >&2
    touch "$staging/.installed"
    rm -rf "$root"
    mv "$staging" "$root"
    trap - EXIT
  fi
fi
echo "$root/bin"
