# Sourced by scripts/test and scripts/up: make sure PostgreSQL and RabbitMQ answer locally,
# starting the locally installed servers if they are down. Set ORCH_SKIP_SERVER_START=1 to
# use servers managed elsewhere (point ORCH_TEST_DATABASE_URL / ORCH_TEST_AMQP_URL at them).

wait_port() {  # host port seconds
  local i
  for ((i = 0; i < $3 * 4; i++)); do
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return 0
    sleep 0.25
  done
  return 1
}

ensure_servers() {
  [ "${ORCH_SKIP_SERVER_START:-0}" = 1 ] && return 0
  if ! wait_port 127.0.0.1 5432 1; then
    echo "starting PostgreSQL…"
    if command -v pg_ctlcluster >/dev/null; then
      pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
    else
      echo "PostgreSQL is not running on 127.0.0.1:5432 and pg_ctlcluster is not installed" >&2
      return 1
    fi
    wait_port 127.0.0.1 5432 30 || { echo "PostgreSQL did not come up" >&2; return 1; }
  fi
  if ! wait_port 127.0.0.1 5672 1; then
    echo "starting RabbitMQ…"
    command -v rabbitmq-server >/dev/null || {
      echo "RabbitMQ is not running on 127.0.0.1:5672 and rabbitmq-server is not installed" >&2
      return 1
    }
    rabbitmq-server -detached
    wait_port 127.0.0.1 5672 90 || { echo "RabbitMQ did not come up" >&2; return 1; }
  fi
}

ensure_venv() {
  if [ ! -x .venv/bin/orch ] || [ pyproject.toml -nt .venv/.installed ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet -e '.[dev]'
    touch .venv/.installed
  fi
}
