#!/usr/bin/env bash
# `make test`: the unit tests run in the background (one core's work, no cluster) while the
# integration tests run here; the integration run's summary by area includes the unit run's
# (tests/areas.py). Fails when either fails.
set -u
cd "$(dirname "$0")/.."
unit_log=.test-unit.log
unit_areas=$(mktemp)
rm -f "$unit_areas"
echo "[test $(date +%H:%M:%S)] unit tests in the background (log: $unit_log)"
RAYATTN_AREAS_OUT=$unit_areas .venv/bin/python -m pytest -q tests/unit >"$unit_log" 2>&1 &
unit=$!
trap 'kill $unit 2>/dev/null' INT TERM
echo "[test $(date +%H:%M:%S)] integration tests: the lifecycle tests start and stop whole" \
  "clusters first, then one Ray cluster serves every other integration test"
RAYATTN_AREAS_MERGE=$unit_areas RAYATTN_AREAS_MERGE_PID=$unit \
  .venv/bin/python -m pytest -v --durations=15 tests/integration "$@"
integration_rc=$?
wait $unit
unit_rc=$?
if [ $unit_rc -ne 0 ]; then
  echo "[test] the unit tests failed ($unit_log):"
  sed -n '/= FAILURES =\|= ERRORS =/,$p' "$unit_log" | tail -n 80
fi
rm -f "$unit_areas"
[ $integration_rc -eq 0 ] && [ $unit_rc -eq 0 ]
