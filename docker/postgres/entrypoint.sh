#!/bin/sh
# PostgreSQL entrypoint of the locally built image. It honours the official postgres image's
# interface (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB, PGDATA, "postgres -c ..." as the
# command), so the same container settings work with both images.
set -eu
export PGDATA="${PGDATA:-/var/lib/postgresql/data}"
bin=/usr/lib/postgresql/15/bin
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown -R postgres:postgres "$PGDATA" /var/run/postgresql
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" > "$pwfile"
  "$bin/initdb" -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C --no-sync >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != "postgres" ]; then
    "$bin/postgres" --single -D "$PGDATA" postgres <<SQL >/dev/null
CREATE DATABASE "$db" OWNER "$user";
SQL
  fi
fi
[ "${1:-postgres}" = postgres ] && [ $# -gt 0 ] && shift
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' "$@"
