#!/usr/bin/env bash
# make test's pytest: the integration tests (real engines, tests/integration)
# and the rest (no engine: unit, fault and deploy tests) as two pytest
# sessions at once. The integration tests leave a core idle much of the time
# (a request goes through one process after another), which the ~3 minutes
# of the others fill; each session has its own systems, ports, base directory
# and state store (tests/conftest.py). The others run at a lower priority
# (nice 10): they end minutes before the integration session, whose length is
# the suite's, so where both want a core the integration tests get it. The
# other session's report follows the integration one's; the status is
# non-zero when either failed.
#
# Arguments go to both; when one names tests by path (tests/gateway,
# tests/x.py::test_y), a single session runs what they name.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=("${VENV:-.venv}/bin/python" -m pytest)

for arg in "$@"; do
    if [[ $arg != -* && -e ${arg%%::*} ]]; then
        exec "${PYTEST[@]}" "$@"
    fi
done

others_log=$(mktemp -t llmgate-tests-XXXXXX.log)
trap 'rm -f "$others_log"' EXIT
nice -n 10 "${PYTEST[@]}" tests --ignore=tests/integration "$@" >"$others_log" 2>&1 &
others=$!
"${PYTEST[@]}" tests/integration "$@"
integration_status=$?
wait "$others"
others_status=$?

echo
echo "==================== the tests without an engine (a session of their own) ===================="
cat "$others_log"
echo
echo "integration tests: exit status $integration_status; the others: exit status $others_status"
# 5: a session whose selection (-k, -m) left it no test; not a failure while
# the other ran some.
if [[ $integration_status -eq 5 && $others_status -eq 5 ]]; then
    exit 5
fi
for status in "$integration_status" "$others_status"; do
    if [[ $status -ne 0 && $status -ne 5 ]]; then
        exit 1
    fi
done
