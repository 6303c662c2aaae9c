# shellcheck shell=bash
# The PostgreSQL the tests use, sourced by .ci/run (and by tests/cli/test_ci_postgres.py alone).
#
#   pg_pick      reach $TOOLGUARD_TEST_DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test);
#                if it is a packaged cluster that is down on that port, start it (root); if it
#                still cannot be reached (not installed, not running, or a password it does not
#                have: Debian's clusters use scram-sha-256 for host connections), start a private
#                cluster instead: initdb with trust auth in a temp dir, a free loopback port, a
#                database of the URL's name. Exports TOOLGUARD_TEST_DATABASE_URL to what it picked.
#   pg_cleanup   stop what pg_pick started (the private cluster by its pg_ctl and data dir, the
#                packaged cluster by pg_ctlcluster), and nothing else.
#
# It never stops, restarts or changes a server it did not start. PostgreSQL refuses to run as
# root, so as root the private cluster runs as the postgres OS user (runuser).

PG_BIN="${TOOLGUARD_PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_STARTED_CLUSTER=""
PG_PRIVATE_DIR=""
PG_PRIVATE_PID=""

pg_ok() { psql "$1" -Atqc 'SELECT 1' >/dev/null 2>&1; }

_pg_url_part() {
  python3 -c 'import sys, urllib.parse as u
p = u.urlsplit(sys.argv[1])
print({"port": p.port or 5432, "host": p.hostname or "127.0.0.1", "db": p.path.lstrip("/") or "test",
       "admin": u.urlunsplit(p._replace(path="/postgres"))}[sys.argv[2]])' "$1" "$2"
}

_pg_as_owner() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

_pg_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Start the private cluster; on success sets TOOLGUARD_TEST_DATABASE_URL to its database $1.
_pg_start_private() {
  local db="$1" port
  [ -x "$PG_BIN/initdb" ] && [ -x "$PG_BIN/pg_ctl" ] || { echo "no initdb/pg_ctl in $PG_BIN" >&2; return 1; }
  PG_PRIVATE_DIR="$(mktemp -d /tmp/toolguard-ci-pg.XXXXXX)"
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$PG_PRIVATE_DIR"; fi
  port="$(_pg_free_port)"
  _pg_as_owner "$PG_BIN/initdb" -D "$PG_PRIVATE_DIR/data" -U postgres --auth=trust -E UTF8 \
    --no-sync --no-instructions >"$PG_PRIVATE_DIR/initdb.log" 2>&1 \
    || { cat "$PG_PRIVATE_DIR/initdb.log" >&2; return 1; }
  _pg_as_owner "$PG_BIN/pg_ctl" -D "$PG_PRIVATE_DIR/data" -l "$PG_PRIVATE_DIR/server.log" -w -t 60 \
    -o "-p $port -k $PG_PRIVATE_DIR -c listen_addresses=127.0.0.1" start >/dev/null \
    || { cat "$PG_PRIVATE_DIR/server.log" >&2; return 1; }
  PG_PRIVATE_PID="$(head -n1 "$PG_PRIVATE_DIR/data/postmaster.pid")"
  psql "postgresql://postgres@127.0.0.1:$port/postgres" -qc "CREATE DATABASE \"$db\"" >/dev/null || return 1
  export TOOLGUARD_TEST_DATABASE_URL="postgresql://postgres@127.0.0.1:$port/$db"
  echo "started a private PostgreSQL cluster (pid $PG_PRIVATE_PID, port $port, $PG_PRIVATE_DIR), stopped again at the end"
}

pg_pick() {
  local url="${TOOLGUARD_TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/test}"
  local admin host port db cluster
  admin="$(_pg_url_part "$url" admin)"; host="$(_pg_url_part "$url" host)"
  port="$(_pg_url_part "$url" port)"; db="$(_pg_url_part "$url" db)"
  export TOOLGUARD_TEST_DATABASE_URL="$url"
  if ! pg_ok "$admin" && [ "$host" = 127.0.0.1 ] && ! pg_isready -h "$host" -p "$port" -q \
      && [ "$(id -u)" = 0 ] && command -v pg_lsclusters >/dev/null 2>&1; then
    # A packaged cluster installed on that port but not running (apt-get starts none here).
    cluster="$(pg_lsclusters -h 2>/dev/null | awk -v port="$port" '$3 == port && $4 == "down" {print $1, $2}' | head -n1)"
    if [ -n "$cluster" ]; then
      # shellcheck disable=SC2086
      if pg_ctlcluster --skip-systemctl-redirect $cluster start; then
        PG_STARTED_CLUSTER="$cluster"
        for _ in $(seq 100); do pg_isready -h "$host" -p "$port" -q && break; sleep 0.1; done
        echo "started cluster $cluster, stopped again at the end"
      fi
    fi
  fi
  if pg_ok "$admin"; then
    if ! pg_ok "$url"; then
      psql "$admin" -qc "CREATE DATABASE \"$db\"" && echo "created database $db"
    fi
    pg_ok "$url" && echo "using $url" && return 0
  fi
  echo "cannot connect to $admin as it is configured (not running, or it wants a password);" \
       "starting a private cluster instead"
  _pg_start_private "$db" && pg_ok "$TOOLGUARD_TEST_DATABASE_URL"
}

pg_cleanup() {
  if [ -n "$PG_PRIVATE_DIR" ]; then
    if [ -f "$PG_PRIVATE_DIR/data/postmaster.pid" ]; then
      echo "stopping the private PostgreSQL cluster (pid $PG_PRIVATE_PID)"
      _pg_as_owner "$PG_BIN/pg_ctl" -D "$PG_PRIVATE_DIR/data" -m fast -w -t 60 stop >/dev/null || true
      # pg_ctl returns when the pid file is gone, a moment before the postmaster has exited.
      for _ in $(seq 300); do [ -n "$PG_PRIVATE_PID" ] && kill -0 "$PG_PRIVATE_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -rf "$PG_PRIVATE_DIR"
    PG_PRIVATE_DIR=""
  fi
  if [ -n "$PG_STARTED_CLUSTER" ]; then
    echo "stopping the PostgreSQL cluster this script started ($PG_STARTED_CLUSTER)"
    # shellcheck disable=SC2086
    pg_ctlcluster --skip-systemctl-redirect $PG_STARTED_CLUSTER stop || true
    PG_STARTED_CLUSTER=""
  fi
}
