# shellcheck shell=bash
# A throwaway Postgres cluster for scripts, when none is running: source this file, then call `pg_local_ensure`.
#
# With DATABASE_URL set to anything but the default (postgres://postgres@127.0.0.1:5432/postgres), or with a server
# answering at 127.0.0.1:5432 (OUTBOX_PG_PROBE=host:port overrides the address probed), it only exports
# DATABASE_URL (the default when unset). Otherwise it starts a cluster from the server binaries on this machine
# (initdb and pg_ctl, from `pg_config --bindir`, /usr/lib/postgresql/*/bin or PATH; scripts/install-postgres
# installs them) in target/pg-local/<pid>/ on a loopback port the kernel has just handed out (and on another when
# the server finds it taken by then: Postgres cannot take port 0): trust auth, user postgres, TCP only, durability
# off. It exports DATABASE_URL pointing at it, says so on stderr, and stops it and removes its
# directory when the calling script exits (an EXIT trap; Ctrl-C and TERM exit through it too). A caller must
# therefore run its command as a child, not with `exec`. As root, initdb and pg_ctl run as the `postgres` user
# (initdb refuses root), under the temp directory when that user cannot write below target/.
#
# outbox-dev dev does the same in Rust (outbox_testkit::pg_local); both record the starting pid in owner.pid, and a
# cluster whose starter is gone (killed) is stopped and removed by the next start.

PG_LOCAL_DEFAULT_URL=postgres://postgres@127.0.0.1:5432/postgres

# Whether something accepts TCP connections at host:port within a second.
pg_local_answers() {
  local host=${1%:*} port=${1##*:}
  timeout 1 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null
}

# The directory with initdb and pg_ctl, or nothing.
pg_local_bindir() {
  local d
  if command -v pg_config >/dev/null 2>&1; then
    d=$(pg_config --bindir 2>/dev/null || true)
    if [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return; fi
  fi
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return; fi
  done
  d=$(command -v initdb 2>/dev/null || true)
  if [ -n "$d" ] && [ -x "$(dirname "$d")/pg_ctl" ]; then dirname "$d"; fi
}

# Runs a server binary, as the postgres user when root.
pg_local_run() {
  local tool=$1; shift
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$PG_LOCAL_BIN/$tool" "$@"
  else
    "$PG_LOCAL_BIN/$tool" "$@"
  fi
}

# Stops the server in a cluster directory (immediate: nothing in it is kept) and removes the directory.
pg_local_stop() {
  local dir=$1
  if [ -f "$dir/data/postmaster.pid" ]; then
    pg_local_run pg_ctl -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$dir"
}

# Stops and removes the clusters under a parent directory whose starting process is gone.
pg_local_sweep() {
  local d owner
  [ -d /proc/self ] || return 0
  for d in "$1"/*/; do
    [ -f "$d/owner.pid" ] || continue
    owner=$(cat "$d/owner.pid")
    [ -d "/proc/$owner" ] || pg_local_stop "${d%/}"
  done
}

# Makes a cluster directory under a parent, owned by the user the server runs as.
pg_local_mkdir() {
  mkdir -p "$1"
  echo $$ > "$1/owner.pid"
  if [ "$(id -u)" = 0 ]; then chown postgres: "$1"; fi
}

pg_local_ensure() {
  local probe=${OUTBOX_PG_PROBE:-127.0.0.1:5432}
  local url=${DATABASE_URL:-$PG_LOCAL_DEFAULT_URL}
  export DATABASE_URL=$url
  if [ "$url" != "$PG_LOCAL_DEFAULT_URL" ] || pg_local_answers "$probe"; then
    return 0
  fi
  PG_LOCAL_BIN=$(pg_local_bindir)
  if [ -z "$PG_LOCAL_BIN" ]; then
    echo "no Postgres at $probe, and the server binaries (initdb, pg_ctl) to start one are not installed:" \
      "run scripts/install-postgres (Debian's postgresql package), or start a Postgres and set DATABASE_URL" >&2
    return 1
  fi
  if [ "$(id -u)" = 0 ] && ! id -u postgres >/dev/null 2>&1; then
    echo "no Postgres at $probe; running as root, and initdb refuses root: there is no postgres user to run it" \
      "as (scripts/install-postgres creates it), or start a Postgres and set DATABASE_URL" >&2
    return 1
  fi
  local here parent port attempt
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  parent=$here/target/pg-local
  pg_local_sweep "$parent"
  PG_LOCAL_DIR=$parent/$$
  pg_local_mkdir "$PG_LOCAL_DIR"
  if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -w "$PG_LOCAL_DIR"; then
    rm -rf "$PG_LOCAL_DIR"
    parent=${TMPDIR:-/tmp}/outbox-pg-local
    pg_local_sweep "$parent"
    PG_LOCAL_DIR=$parent/$$
    pg_local_mkdir "$PG_LOCAL_DIR"
  fi
  trap 'pg_local_stop "$PG_LOCAL_DIR"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  if ! pg_local_run initdb -D "$PG_LOCAL_DIR/data" -U postgres -A trust -E UTF8 --locale=C --no-sync \
    >"$PG_LOCAL_DIR/initdb.log" 2>&1; then
    cat "$PG_LOCAL_DIR/initdb.log" >&2
    return 1
  fi
  cat >> "$PG_LOCAL_DIR/data/postgresql.conf" <<CONF

# outbox throwaway cluster (scripts/lib/pg-local.sh); the port is pg_ctl's -o -p
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
CONF
  for attempt in 1 2 3 4 5 6 7 8; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    rm -f "$PG_LOCAL_DIR/server.log"
    if pg_local_run pg_ctl -D "$PG_LOCAL_DIR/data" -l "$PG_LOCAL_DIR/server.log" -o "-p $port" -w -t 60 start \
      >/dev/null; then
      break
    fi
    if [ "$attempt" = 8 ] || ! grep -q 'Address already in use' "$PG_LOCAL_DIR/server.log"; then
      cat "$PG_LOCAL_DIR/server.log" >&2
      return 1
    fi
  done
  export DATABASE_URL=postgres://postgres@127.0.0.1:$port/postgres
  echo "no Postgres at $probe; started a throwaway cluster at $DATABASE_URL (in $PG_LOCAL_DIR; stopped at exit)" >&2
}
