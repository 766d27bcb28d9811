#!/usr/bin/env bash
# The README's test command (`make test`): set up .venv, start the services the tests need
# (each scripts/services/*.sh, in name order, on loopback), run the whole suite, stop them.
# A service script is sourced with `start` or `stop` as its argument; `start` installs what it
# needs if missing and exports the variables tests read (for example KVSTORE_TEST_REDIS_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
services=(scripts/services/*.sh)
stop_services() {
    for script in "${services[@]}"; do
        [ -f "$script" ] && { source "$script" stop || true; }
    done
}
trap stop_services EXIT
for script in "${services[@]}"; do
    [ -f "$script" ] && source "$script" start
done
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q "$@"
