.PHONY: setup generate test
setup:
	bash scripts/setup.sh

generate: setup
	.venv/bin/jetspec generate --compare

test: setup
	.venv/bin/python -m pytest -q -n 2 --durations=15
