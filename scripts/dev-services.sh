#!/usr/bin/env bash
# Local Postgres and Redis for development and tests.
#
#   scripts/dev-services.sh up     use the servers answering at DATABASE_URL /
#                                  REDIS_URL, or start local ones (data under
#                                  .dev/, installing Debian packages if missing)
#   scripts/dev-services.sh down   stop only the servers this script started
#   scripts/dev-services.sh status
#   scripts/dev-services.sh tools  install the server binaries (Postgres,
#                                  pgbench, Redis) without starting anything,
#                                  for make bench, which starts its own
#   scripts/dev-services.sh ha-tools  the same, and Patroni, etcd, HAProxy and PgBouncer
#                                  for the HA test (make test), which starts
#                                  its own
#   scripts/dev-services.sh test-tools  the same, and openssl, python3-venv
#                                  and npm: all make test needs from Debian
#
# Servers this script did not start are never stopped or reconfigured.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/idpool}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}

say() { echo "dev-services: $*" >&2; }

# host and port out of scheme://[user@]host:port[/...]
url_host() { local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}; rest=${rest%%\?*}; echo "${rest%%:*}"; }
url_port() {
  local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}; rest=${rest%%\?*}
  if [[ $rest == *:* ]]; then echo "${rest##*:}"; else echo "$2"; fi
}
url_user() {
  local rest=${1#*://}
  if [[ $rest == *@* ]]; then rest=${rest%%@*}; echo "${rest%%:*}"; else echo postgres; fi
}

pg_host=$(url_host "$DATABASE_URL"); pg_port=$(url_port "$DATABASE_URL" 5432); pg_user=$(url_user "$DATABASE_URL")
redis_host=$(url_host "$REDIS_URL"); redis_port=$(url_port "$REDIS_URL" 6379)

as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root to run: $*"; return 1; fi
}

apt_install() {
  say "installing Debian packages: $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_bindir() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    [[ -x $dir/initdb ]] && { echo "$dir"; return 0; }
  done
  return 1
}

pg_answers() {
  if command -v pg_isready >/dev/null; then
    pg_isready -q -h "$pg_host" -p "$pg_port" -t 2
  else
    (exec 3<>"/dev/tcp/$pg_host/$pg_port") 2>/dev/null
  fi
}

redis_answers() {
  if command -v redis-cli >/dev/null; then
    [[ $(redis-cli -h "$redis_host" -p "$redis_port" ping 2>/dev/null) == PONG ]]
  else
    (exec 3<>"/dev/tcp/$redis_host/$redis_port") 2>/dev/null
  fi
}

# Postgres refuses to run as root: run its tools as the postgres user then.
as_pg_owner() {
  if [[ $(id -u) -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir "$dev" --shell /bin/sh postgres
    chown -R postgres "$dev/postgres"
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

postgres_up() {
  if pg_answers; then
    say "postgres answers at $pg_host:$pg_port; using it"
    return 0
  fi
  if [[ $pg_host != 127.0.0.1 && $pg_host != localhost ]]; then
    say "postgres at $pg_host:$pg_port does not answer and is not local; start it yourself"
    return 1
  fi
  local bindir
  bindir=$(pg_bindir) || { apt_install postgresql postgresql-contrib; bindir=$(pg_bindir); }
  mkdir -p "$dev/postgres"
  if [[ ! -f $dev/postgres/data/PG_VERSION ]]; then
    say "initdb in .dev/postgres/data"
    as_pg_owner "$bindir/initdb" -D "$dev/postgres/data" -U "$pg_user" --auth=trust -E UTF8 >/dev/null
  fi
  say "starting postgres on port $pg_port"
  as_pg_owner "$bindir/pg_ctl" -D "$dev/postgres/data" -l "$dev/postgres/server.log" -w -t 60 \
    -o "-p $pg_port -k $dev/postgres -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=on" start >/dev/null
  touch "$dev/postgres/started-by-us"
}

redis_up() {
  if ! command -v redis-server >/dev/null; then
    # Tests that kill and restart Redis start their own redis-server.
    apt_install redis-server redis-tools
  fi
  if redis_answers; then
    say "redis answers at $redis_host:$redis_port; using it"
    return 0
  fi
  if [[ $redis_host != 127.0.0.1 && $redis_host != localhost ]]; then
    say "redis at $redis_host:$redis_port does not answer and is not local; start it yourself"
    return 1
  fi
  mkdir -p "$dev/redis"
  say "starting redis on port $redis_port"
  redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --dir "$dev/redis" --pidfile "$dev/redis/redis.pid" --logfile "$dev/redis/redis.log"
  for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
  touch "$dev/redis/started-by-us"
}

down() {
  if [[ -f $dev/postgres/started-by-us ]]; then
    local bindir; bindir=$(pg_bindir)
    as_pg_owner "$bindir/pg_ctl" -D "$dev/postgres/data" -m fast stop >/dev/null || true
    rm -f "$dev/postgres/started-by-us"
    say "stopped the postgres we started"
  fi
  if [[ -f $dev/redis/started-by-us ]]; then
    [[ -f $dev/redis/redis.pid ]] && kill "$(cat "$dev/redis/redis.pid")" 2>/dev/null || true
    rm -f "$dev/redis/started-by-us"
    say "stopped the redis we started"
  fi
}

tools() {
  pg_bindir >/dev/null || apt_install postgresql postgresql-contrib
  [[ -x $(pg_bindir)/pgbench ]] || command -v pgbench >/dev/null || apt_install postgresql-contrib
  command -v redis-server >/dev/null || apt_install redis-server redis-tools
}

# The Postgres high-availability stack the HA test runs (Debian's packages):
# Patroni, etcd and HAProxy. Nothing is started here; the test starts its
# own on free loopback ports. Debian's packages start system services on
# install: those are stopped and disabled again, never left running.
ha_tools() {
  tools
  local missing=()
  command -v patroni >/dev/null || missing+=(patroni python3-psycopg2)
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v haproxy >/dev/null || missing+=(haproxy)
  command -v pgbouncer >/dev/null || missing+=(pgbouncer)
  if (( ${#missing[@]} )); then
    apt_install "${missing[@]}"
    for service in etcd haproxy patroni pgbouncer; do
      if command -v systemctl >/dev/null && systemctl is-active --quiet "$service" 2>/dev/null; then
        as_root systemctl disable --now "$service" >/dev/null 2>&1 || true
      fi
    done
  fi
}

# Everything else `make test` runs (Debian's packages): openssl for the TLS
# tests' certificates, python3's venv and npm for the SDK tools.
test_tools() {
  ha_tools
  local missing=()
  command -v openssl >/dev/null || missing+=(openssl)
  python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
  command -v npm >/dev/null || missing+=(npm)
  if (( ${#missing[@]} )); then apt_install "${missing[@]}"; fi
}

case ${1:-up} in
  up) postgres_up; redis_up ;;
  tools) tools ;;
  ha-tools) ha_tools ;;
  test-tools) test_tools ;;
  down) down ;;
  status)
    pg_answers && say "postgres up at $pg_host:$pg_port" || say "postgres down at $pg_host:$pg_port"
    redis_answers && say "redis up at $redis_host:$redis_port" || say "redis down at $redis_host:$redis_port"
    ;;
  *) echo "usage: $0 up|down|status|tools|ha-tools|test-tools" >&2; exit 2 ;;
esac
