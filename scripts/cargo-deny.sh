#!/usr/bin/env bash
# cargo-deny, pinned (installed once per machine by scripts/cargo-tool.sh),
# and its advisory database, laid out under target/tools from the snapshot
# in .ci/advisory-db: this machine reaches the package registries only, so
# the database is never fetched.
# Idempotent. Prints the directory to put on PATH.
#
# Refreshing the snapshot (on a machine that reaches GitHub):
#   git clone --depth 1 https://github.com/rustsec/advisory-db /tmp/adb
#   git -C /tmp/adb archive --format=tar HEAD | gzip -9n > .ci/advisory-db/snapshot.tar.gz
#   git -C /tmp/adb log -1 --format='%H %cI' > .ci/advisory-db/SNAPSHOT
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(scripts/cargo-tool.sh cargo-deny 0.20.2)
root=$PWD/target/tools

# cargo-deny looks for the database of deny.toml's db-urls here (the
# name is a hash of that URL) and wants a git checkout.
snapshot=.ci/advisory-db/snapshot.tar.gz
read -r commit committed < .ci/advisory-db/SNAPSHOT
db=$root/advisory-dbs/advisory-db-3157b0e258782691
if [[ $(cat "$db/.snapshot" 2>/dev/null) != "$commit" ]]; then
  rm -rf "$db"
  mkdir -p "$db"
  tar -xzf "$snapshot" -C "$db"
  (
    cd "$db"
    export GIT_AUTHOR_DATE=$committed GIT_COMMITTER_DATE=$committed
    git init -q -b main
    git add -A
    git -c user.name=idpool -c user.email=ci@idpool.invalid commit -q -m "advisory-db $commit"
    # Its age is the snapshot's, not this unpacking's: cargo-deny reads it
    # from the mtime of HEAD when it is newer than the commit.
    touch -d "$committed" .git/HEAD
  )
  echo "$commit" > "$db/.snapshot"
fi
echo "$bin"
