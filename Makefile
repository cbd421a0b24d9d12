# The two commands of the README: `make demo` and `make test`. Both set everything up.
.PHONY: setup demo test test-fast test-all lint

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/rayrl demo

lint: setup
	.venv/bin/ruff check src tests bench
	.venv/bin/ruff format --check src tests bench
	.venv/bin/mypy src

test: lint
	MARK="not slow or command" bash scripts/run_tests.sh

test-fast: setup
	MARK="not slow" bash scripts/run_tests.sh

test-all: lint
	bash scripts/run_tests.sh
