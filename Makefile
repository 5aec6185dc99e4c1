# The two commands of the README's quickstart. Each installs what is missing first, into the
# virtual environment $(VENV) (scripts/bootstrap.sh; versions from constraints.txt).
.PHONY: demo test test-scenarios bootstrap lint

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

lint: bootstrap
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && PYTHON=$(PYTHON) scripts/typecheck.sh
