# Sourced by scripts/test and scripts/up: make sure PostgreSQL and RabbitMQ answer locally.
#
# A server that is down but installed is started. One that is not installed is installed with
# apt on Debian or Ubuntu when we run as root (a fresh PostgreSQL is then set to trust local TCP
# connections, as the default URLs expect); otherwise the one command that would provide it is
# printed. Set ORCH_SKIP_SERVER_START=1 to use servers managed elsewhere (point
# ORCH_TEST_DATABASE_URL / ORCH_TEST_AMQP_URL or ORCH_DATABASE_URL / ORCH_AMQP_URL at them).
# ORCH_SERVERS_DRY_RUN=1 prints what would be run instead of running it.

PG_PORT="${ORCH_PG_PORT:-5432}"
AMQP_PORT="${ORCH_AMQP_PORT:-5672}"

wait_port() {  # host port seconds
  local i
  for ((i = 0; i < $3 * 4; i++)); do
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return 0
    sleep 0.25
  done
  return 1
}

run() {  # a command, or what it would be in a dry run
  if [ "${ORCH_SERVERS_DRY_RUN:-0}" = 1 ]; then
    echo "would run: $*"
  else
    "$@"
  fi
}

can_apt() {  # root, apt-get, and Debian or Ubuntu
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  grep -qiE '^(ID|ID_LIKE)=.*(debian|ubuntu)' "${ORCH_OS_RELEASE:-/etc/os-release}" 2>/dev/null
}

apt_install() {
  echo "installing $* with apt…"
  run env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

cannot_install() {  # what
  cat >&2 <<EOF
$1 is not running on 127.0.0.1 and cannot be installed here (not root on Debian or Ubuntu).
Start the servers with Docker, on the ports and with the access the defaults expect:
  docker run -d --name orch-postgres -e POSTGRES_HOST_AUTH_METHOD=trust -p 127.0.0.1:$PG_PORT:5432 postgres:16
  docker run -d --name orch-rabbitmq -p 127.0.0.1:$AMQP_PORT:5672 rabbitmq:3.13
or point ORCH_DATABASE_URL / ORCH_AMQP_URL (tests: ORCH_TEST_DATABASE_URL / ORCH_TEST_AMQP_URL)
at servers you have, and set ORCH_SKIP_SERVER_START=1.
EOF
  return 1
}

trust_local_tcp() {  # a PostgreSQL we installed ourselves: the default URLs use no password
  local hba
  hba=$(ls /etc/postgresql/*/main/pg_hba.conf 2>/dev/null | sort -V | tail -n 1)
  [ -n "$hba" ] || return 0
  grep -q "orchestrator: trust local TCP" "$hba" && return 0
  if [ "${ORCH_SERVERS_DRY_RUN:-0}" = 1 ]; then
    echo "would trust local TCP connections in $hba"
    return 0
  fi
  local tmp
  tmp=$(mktemp)
  {
    echo "# orchestrator: trust local TCP (installed by scripts/servers.sh)"
    echo "host all all 127.0.0.1/32 trust"
    echo "host all all ::1/128 trust"
    cat "$hba"
  } >"$tmp" && cat "$tmp" >"$hba"
  rm -f "$tmp"
}

ensure_postgres() {
  wait_port 127.0.0.1 "$PG_PORT" 1 && return 0
  if ! command -v pg_ctlcluster >/dev/null; then
    can_apt || cannot_install PostgreSQL || return 1
    apt_install postgresql || return 1
    trust_local_tcp
  fi
  echo "starting PostgreSQL…"
  run pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)" main start
  [ "${ORCH_SERVERS_DRY_RUN:-0}" = 1 ] && return 0
  wait_port 127.0.0.1 "$PG_PORT" 30 || { echo "PostgreSQL did not come up" >&2; return 1; }
}

ensure_rabbitmq() {
  wait_port 127.0.0.1 "$AMQP_PORT" 1 && return 0
  if ! command -v rabbitmq-server >/dev/null; then
    can_apt || cannot_install RabbitMQ || return 1
    apt_install rabbitmq-server || return 1
  fi
  echo "starting RabbitMQ…"
  run rabbitmq-server -detached
  [ "${ORCH_SERVERS_DRY_RUN:-0}" = 1 ] && return 0
  wait_port 127.0.0.1 "$AMQP_PORT" 90 || { echo "RabbitMQ did not come up" >&2; return 1; }
}

REDIS_PORT=${ORCH_TEST_REDIS_PORT:-6379}

ensure_redis() {  # only the tests of the Redis fence need it; running the system never does
  wait_port 127.0.0.1 "$REDIS_PORT" 1 && return 0
  if ! command -v redis-server >/dev/null; then
    can_apt || cannot_install Redis || return 1
    apt_install redis-server || return 1
  fi
  echo "starting Redis…"
  run redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --daemonize yes --save "" --appendonly no
  [ "${ORCH_SERVERS_DRY_RUN:-0}" = 1 ] && return 0
  wait_port 127.0.0.1 "$REDIS_PORT" 30 || { echo "Redis did not come up" >&2; return 1; }
}

ensure_servers() {
  [ "${ORCH_SKIP_SERVER_START:-0}" = 1 ] && return 0
  ensure_postgres && ensure_rabbitmq
}

ensure_browser() {  # the console's browser test drives Debian's chromium
  command -v chromium >/dev/null && return 0
  if can_apt; then
    apt_install chromium chromium-driver
  else
    echo "chromium is not installed; the console test needs it (apt-get install chromium)" >&2
    return 1
  fi
}

ensure_faketime() {  # the clock tests shift a service's clocks with Debian's libfaketime
  [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] && return 0
  if can_apt; then
    apt_install faketime
  else
    echo "libfaketime is not installed; the clock tests are skipped (apt-get install faketime)" >&2
    return 0
  fi
}

ensure_auto_failover() {  # the automatic failover test runs Debian's pg_auto_failover
  command -v pg_autoctl >/dev/null &&
    ls /usr/lib/postgresql/*/lib/pgautofailover.so >/dev/null 2>&1 && return 0
  can_apt && apt_install postgresql-15-auto-failover pg-auto-failover-cli && return 0
  echo "pg_auto_failover is not installed; its failover test is skipped" \
    "(apt-get install postgresql-15-auto-failover pg-auto-failover-cli)" >&2
  return 0
}

install_venv() {  # marker pip-target: (re)install the project into .venv when it is stale
  if [ ! -x .venv/bin/orch ] || [ ! -e ".venv/$1" ] || [ pyproject.toml -nt ".venv/$1" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet -e "$2"
    touch ".venv/$1"
  fi
}

ensure_run_venv() {  # what running the system needs: the project, no dev tools (scripts/up)
  [ -e .venv/.installed-dev ] && [ ! pyproject.toml -nt .venv/.installed-dev ] && return 0
  install_venv .installed-run .
}

ensure_venv() {  # the project with its dev extras: tests, linters, browser (scripts/test)
  install_venv .installed-dev '.[dev]'
}
