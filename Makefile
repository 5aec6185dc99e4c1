# The two commands of the README's quickstart. Each installs what is missing first.
.PHONY: demo test bootstrap lint

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	lmq demo

test: bootstrap
	python3 -m pytest

lint:
	ruff check . && ruff format --check . && mypy
