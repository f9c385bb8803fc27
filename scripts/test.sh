#!/usr/bin/env bash
# make test's pytest, as three sessions at once:
#
# * the integration tests on the session's system (real engine,
#   tests/integration): the longest, whose length is the suite's;
# * the integration modules that start systems of their own and never use the
#   session's (ALONE below): beside the first, so their engine starts and
#   tests fill the core it leaves idle much of the time (a request goes
#   through one process after another) instead of adding ~2 minutes to it;
#   each system starts when its module does (--no-prestart), so this session
#   holds one engine at a time beside the first one's (gigabytes each);
# * the rest (no engine: unit, fault and deploy tests) at a lower priority
#   (nice 10): they end minutes before the integration session, so where both
#   want a core the integration tests get it.
#
# Each session has its own systems, ports, base directory and state store
# (tests/conftest.py). The reports follow one another; the status is non-zero
# when any session failed.
#
# Arguments go to every session; when one names tests by path (tests/gateway,
# tests/x.py::test_y), a single session runs what they name.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=("${VENV:-.venv}/bin/python" -m pytest)
# None of their tests may use the integration session's system (`served`):
# tests/test_sessions.py checks.
ALONE=(
    tests/integration/test_curve.py
    tests/integration/test_launcher_processes.py
    tests/integration/test_tracing.py
)

for arg in "$@"; do
    if [[ $arg != -* && -e ${arg%%::*} ]]; then
        exec "${PYTEST[@]}" "$@"
    fi
done

alone_log=$(mktemp -t llmgate-tests-XXXXXX.log)
others_log=$(mktemp -t llmgate-tests-XXXXXX.log)
trap 'rm -f "$alone_log" "$others_log"' EXIT
"${PYTEST[@]}" "${ALONE[@]}" --no-prestart "$@" >"$alone_log" 2>&1 &
alone=$!
nice -n 10 "${PYTEST[@]}" tests --ignore=tests/integration "$@" >"$others_log" 2>&1 &
others=$!
"${PYTEST[@]}" tests/integration "${ALONE[@]/#/--ignore=}" "$@"
integration_status=$?
wait "$alone"
alone_status=$?
wait "$others"
others_status=$?

echo
echo "==================== the integration modules with systems of their own (a session of their own) ===================="
cat "$alone_log"
echo
echo "==================== the tests without an engine (a session of their own) ===================="
cat "$others_log"
echo
echo "exit status: integration tests $integration_status; modules with their own systems $alone_status; the others $others_status"
# 5: a session whose selection (-k, -m) left it no test; not a failure while
# another ran some.
statuses=("$integration_status" "$alone_status" "$others_status")
if [[ " ${statuses[*]} " == " 5 5 5 " ]]; then
    exit 5
fi
for status in "${statuses[@]}"; do
    if [[ $status -ne 0 && $status -ne 5 ]]; then
        exit 1
    fi
done
