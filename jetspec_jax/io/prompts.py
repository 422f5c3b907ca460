"""Prompt files: one prompt per line, or a .jsonl of {"prompt": ...} objects (no JAX: the CLI
reads them before it loads anything)."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per non-blank line, or for .jsonl one {"prompt": ...} object per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such prompt file: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {data[e.start]:#04x} at "
                         f"offset {e.start}); save it as UTF-8") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"prompt file {path} holds no prompts (it is empty or blank)")
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    return [_jsonl_prompt(path, n, line) for n, line in lines]


def _jsonl_prompt(path: Path, n: int, line: str) -> str:
    try:
        prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError):
        prompt = None
    if not isinstance(prompt, str):
        raise ValueError(f'{path}:{n}: expected a JSON object with a "prompt" string')
    return prompt
