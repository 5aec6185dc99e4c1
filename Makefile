# The two commands of the README's quickstart. Each installs what is missing first.
.PHONY: demo test test-scenarios bootstrap lint

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	lmq demo

test: bootstrap
	python3 -m pytest -m "not scenario"

# The long fault scenarios (tests/faults): kills, restarts, failovers. CI runs them after `test`.
test-scenarios: bootstrap
	python3 -m pytest -m scenario

lint:
	ruff check . && ruff format --check . && scripts/typecheck.sh
