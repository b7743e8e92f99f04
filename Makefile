# The two commands of README.md: `make serve` and `make test`.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export RAY_USAGE_STATS_ENABLED := 0
# Serve's HAProxy ingress for the Ray that `serve run` starts (rayattn/server/front_door.py).
export RAY_SERVE_ENABLE_HA_PROXY ?= 1
export RAY_SERVE_HAPROXY_BALANCE_ALGORITHM ?= hdr(x-session-id)
# Ray's workers, the engines included, at nice 0 as `vllm serve` runs (rayattn/engine/cpu_priority.py).
export RAY_worker_niceness ?= 0

# `make serve CONFIG=deployments/local-multi.yaml` serves another config.
CONFIG ?= deployments/local.yaml

.PHONY: venv serve test lint check

venv:
	./scripts/install.sh

# `rayattn serve` is `serve run` once the ports and CPUs the config needs are known free.
serve: venv
	.venv/bin/rayattn prepare-model
	.venv/bin/rayattn serve $(CONFIG)

check: venv
	.venv/bin/rayattn check deployments/*.yaml

lint: venv
	.venv/bin/ruff check rayattn tests bench

# The metrics test starts a real Prometheus: fetched into .venv/prometheus if not on PATH.
# It ends with one line per area of the suite (tests/areas.py).
test: venv
	@echo "[test] Prometheus for the metrics test"
	./scripts/install-prometheus.sh
	@echo "[test] ruff"
	.venv/bin/ruff check rayattn tests bench
	@echo "[test] pytest: the unit tests in a process of their own beside the integration" \
	  "tests; the lifecycle tests start and stop whole clusters first, then one Ray cluster" \
	  "serves every other integration test"
	PATH="$(CURDIR)/.venv/prometheus/bin:$$PATH" .venv/bin/python -m pytest -v --durations=15 --unit-beside
