# Sourced by scripts/test.sh with `start` or `stop`: a standalone Redis and a 3-master Redis
# cluster on loopback for the remote tier's tests, in a temp dir. `start` installs redis-server
# from the distribution's packages if missing and exports KVSTORE_TEST_REDIS_URL and
# KVSTORE_TEST_REDIS_CLUSTER; `stop` shuts the servers down and removes the dir.

_redis_free_port() {
    python3 -c 'import socket
for _ in range(100):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if p + 10000 < 65536:
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", p + 10000)); b.close(); print(p); break
        except OSError:
            b.close()'
}

_redis_server() {  # port [extra redis-server args...]
    local port=$1; shift
    mkdir -p "$KVSTORE_REDIS_DIR/$port"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$KVSTORE_REDIS_DIR/$port" --logfile "$KVSTORE_REDIS_DIR/$port/redis.log" \
        --pidfile "$KVSTORE_REDIS_DIR/$port/redis.pid" --daemonize yes "$@"
    for _ in $(seq 100); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
        sleep 0.05
    done
    echo "redis-server on port $port did not start" >&2
    return 1
}

_redis_start() {
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
        echo "installing redis-server (apt-get)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
    fi
    KVSTORE_REDIS_DIR=$(mktemp -d /tmp/kvstore-redis.XXXXXX)
    export KVSTORE_REDIS_DIR
    local port nodes=()
    port=$(_redis_free_port)
    _redis_server "$port"
    export KVSTORE_TEST_REDIS_URL="redis://127.0.0.1:$port"
    for _ in 1 2 3; do
        port=$(_redis_free_port)
        _redis_server "$port" --cluster-enabled yes --cluster-config-file nodes.conf \
            --cluster-node-timeout 2000
        nodes+=("127.0.0.1:$port")
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
    for _ in $(seq 200); do
        redis-cli -p "${nodes[0]#*:}" cluster info | grep -q cluster_state:ok && break
        sleep 0.1
    done
    export KVSTORE_TEST_REDIS_CLUSTER="redis://${nodes[0]}"
    echo "redis: standalone $KVSTORE_TEST_REDIS_URL, cluster ${nodes[*]}" >&2
}

_redis_stop() {
    [ -n "${KVSTORE_REDIS_DIR:-}" ] && [ -d "$KVSTORE_REDIS_DIR" ] || return 0
    local pidfile pids=()
    for pidfile in "$KVSTORE_REDIS_DIR"/*/redis.pid; do
        [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
    done
    [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
    for _ in $(seq 50); do  # wait for them to exit, up to 5 s
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    rm -rf "$KVSTORE_REDIS_DIR"
    unset KVSTORE_REDIS_DIR KVSTORE_TEST_REDIS_URL KVSTORE_TEST_REDIS_CLUSTER
}

case "${1:-}" in
    start) _redis_start ;;
    stop) _redis_stop ;;
    *) echo "usage: source scripts/services/redis.sh start|stop" >&2; return 2 ;;
esac
