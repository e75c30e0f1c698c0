#!/bin/sh
# The orchestrator's own RabbitMQ vhost, and one user per role with the least permissions that
# role needs (README, "Security"). Idempotent: run it again after a change of password.
#
# Runs rabbitmqctl, which must reach the node (on it: `kubectl exec -i rabbit-0 -- sh -s <
# deploy/rabbitmq-users.sh`, with the variables below in the environment; compose runs it as
# the one-shot service `broker-users`).
#
#   VHOST             the vhost (default: orchestrator)
#   PREFIX            the names' prefix: the processes' ORCH_PREFIX (default: orch)
#   MANAGER_USER      the user the managers connect as (default: orch-manager), its
#   MANAGER_PASSWORD  password
#   SERVICE_USER      the user the observer services connect as (default: orch-service), its
#   SERVICE_PASSWORD  password
#   CONSUMER_USER     a consumer of outputs (optional), its
#   CONSUMER_PASSWORD password
#   CONSUMER_QUEUE_MAX_LENGTH, CONSUMER_QUEUE_MAX_BYTES
#                     the length policy of every <p>.consumer.* queue (1,000,000 messages,
#                     256 MiB; the oldest dropped first)
#   OPERATOR_USER     an existing user given every permission on the vhost, for
#                     `orch broker-policy` and people (optional)
#
# What each role does on the broker, and so the permissions it gets (configure, write, read are
# regular expressions over exchange and queue names; `amq.default` is the default exchange):
#   both   declare <p>.work (dead-lettering to <p>.dead-letter), <p>.errors bound to
#          <p>.dead-letter, <p>.control and <p>.outputs, at every start and broker session;
#          publish committed outputs (<p>.outputs: a service its own, the leader what a gone
#          service left)
#   manager  publishes starts (default exchange -> <p>.work), broadcasts (<p>.control),
#          directed starts and handoffs (default exchange -> <p>.control.<id>), errors
#          (<p>.dead-letter); consumes nothing
#   service  consumes <p>.work and its own exclusive <p>.control.<id>, which it declares and
#          binds to <p>.control; publishes starts, directed starts (handoff), cancels and errors
# Passive declarations (is a service's control queue there?) need no permission.
set -eu

vhost=${VHOST:-orchestrator}
prefix=${PREFIX:-orch}
manager=${MANAGER_USER:-orch-manager}
service=${SERVICE_USER:-orch-service}
: "${MANAGER_PASSWORD:?set MANAGER_PASSWORD}"
: "${SERVICE_PASSWORD:?set SERVICE_PASSWORD}"

p=$(printf '%s' "$prefix" | sed 's/[].[\\*^$()+?{}|]/\\&/g')
shared="$p\\.(work|errors|dead-letter|control|outputs)"
own="$p\\.control\\.[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

if ! rabbitmqctl -q list_vhosts name | grep -qxF "$vhost"; then
    rabbitmqctl -q add_vhost "$vhost"
fi

user() {  # name password: made, or its password set
    if rabbitmqctl -q list_users | cut -f1 | grep -qxF "$1"; then
        rabbitmqctl -q change_password "$1" "$2"
    else
        rabbitmqctl -q add_user "$1" "$2"
    fi
}

user "$manager" "$MANAGER_PASSWORD"
rabbitmqctl -q set_permissions -p "$vhost" "$manager" \
    "^$shared\$" "^(amq\\.default|$shared)\$" "^$p\\.(work|errors|dead-letter)\$"

user "$service" "$SERVICE_PASSWORD"
rabbitmqctl -q set_permissions -p "$vhost" "$service" \
    "^($shared|$own)\$" "^(amq\\.default|$shared|$own)\$" "^($shared|$own)\$"

# Every <p>.consumer.* queue keeps at most CONSUMER_QUEUE_MAX_LENGTH messages and
# CONSUMER_QUEUE_MAX_BYTES bytes, the oldest dropped first (a consumer's reader sees the gap): a
# stalled consumer never grows until the broker's alarm blocks every publisher.
rabbitmqctl -q set_policy -p "$vhost" "$prefix-consumer-limit" "^$p\.consumer\." \
    "{\"max-length\": ${CONSUMER_QUEUE_MAX_LENGTH:-1000000}, \"max-length-bytes\": ${CONSUMER_QUEUE_MAX_BYTES:-268435456}, \"overflow\": \"drop-head\"}" \
    --apply-to queues --priority 10

# A consumer of outputs (optional): reads <p>.outputs (a passive declaration of the exchange,
# no permission needed, then a binding: read on it) through queues of its own named
# <p>.consumer.<anything>, which it declares, binds and consumes (``orch outputs tail`` too).
if [ -n "${CONSUMER_USER:-}" ]; then
    : "${CONSUMER_PASSWORD:?set CONSUMER_PASSWORD}"
    user "$CONSUMER_USER" "$CONSUMER_PASSWORD"
    rabbitmqctl -q set_permissions -p "$vhost" "$CONSUMER_USER" \
        "^$p\\.consumer\\..+\$" "^$p\\.consumer\\..+\$" "^($p\\.outputs|$p\\.consumer\\..+)\$"
fi

if [ -n "${OPERATOR_USER:-}" ]; then
    rabbitmqctl -q set_permissions -p "$vhost" "$OPERATOR_USER" ".*" ".*" ".*"
fi
echo "vhost $vhost: users $manager and $service set"
