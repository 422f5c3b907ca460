"""The tracked text speaks of the product, not of how it was made: no work-log words in code,
comments, docs, notebooks, scripts, result files or file names. Each hit is reported as
file:line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".sh", ".ipynb", ".toml", ".cfg", ".yml", ".yaml", ".json", ".jsonl", ".txt")

# Each pattern with what it stands for. "carry" is JAX's word for a loop's state, so only its
# file-moving sense is caught: a `.carry` folder or a carry of folders, parts, MiB or a machine.
WORDS = {
    "a work session": r"\bsessions?\b|session\d",
    "a tracker issue": r"\bissues?\b",
    "moving files to a machine": (
        r"\.carry\b|\bcarry_|\bcarry=|\b(?:model|data|file) carry\b"
        r"|\bcarr(?:y|ies|ied|ying)\b[^.\n]{0,50}\b(?:folders?|parts?|MiB|tarball|machine"
        r"|working tree)\b"),
    "the device tool": r"\bdevice tool\b",
    "a lent machine": r"\blent\b",
    "an output-folder variable": r"(?-i:\$OUT\b|\$\{OUT\})",
    "a path on the machine a result was made on": r"(?<![\w.])/root/\w",
    "a machine kind's name": r"nvidia-h\d00|\bh\d00-?x\d\b",
}
PATTERN = re.compile("|".join(f"(?P<w{i}>{p})" for i, p in enumerate(WORDS.values())), re.I)
NAMES = list(WORDS)


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, the word found, what it stands for) for every hit in text."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in PATTERN.finditer(line):
            found.append((n, m.group(0), NAMES[int(m.lastgroup[1:])]))
    return found


def test_the_patterns_catch_the_words_and_spare_jax_carries():
    assert [w for _, w, _ in hits("session 3; see issue 28; pack into carry folders")] == [
        "session", "issue", "carry folders"]
    assert hits("run(carry=['.carry/model1']) on the device tool, $OUT/x.json") != []
    assert hits('"command": "bench.eval_head --out /root/out/eval.json"') != []
    assert hits("--draft runs/head --out bench/results/heads/eval.json") == []
    assert hits("a nvidia-h200-x2 machine, lent for a day") != []
    assert hits("def body(i, carry):\n    cache, last = carry  # the loop's carry") == []
    assert hits("a per-call time carries the host's dispatch; 2 H200s; an H200; $out/x") == []


def test_tracked_text_and_file_names_have_no_process_words():
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    problems = []
    for path in tracked():
        problems += [f"{path}: file name has {w!r} ({what})" for _, w, what in hits(path)]
        if path == me or not path.endswith(TEXT) and Path(path).name != "Makefile":
            continue
        file = ROOT / path
        if not file.is_file():  # deleted in the work tree, not yet in the index
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        problems += [f"{path}:{n}: {w!r} ({what})" for n, w, what in hits(text)]
    assert not problems, f"{len(problems)} process words:\n" + "\n".join(problems[:60])
