"""Self-distillation data: prompts -> the target's own responses -> token shards.

    prompts = read_prompts("prompts.jsonl.xz", split="train")   # train/prompts.py
    make_dataset(tparams, tcfg, tokenizer, prompts, "data/smollm2", shard_size=2048,
                 max_prompt_len=192, max_new=256, batch_size=256, samples=2,
                 sample_sampler=Sampler(temperature=0.8), seed=0)

Each prompt (a message list, or a string for one user turn) gets the target's answer under
`sampler` (greedy by default) and `samples` more answers under `sample_sampler`, each row drawn
with its own key, fold_in(seed, hash of the prompt's text, answer number), so an answer does not
depend on the batch it was decoded in and a resumed run reproduces it. Each shard
`shard-00000.npz` holds
  tokens [S, P + M] int32   chat-templated prompt + response, right-padded
  lengths [S], prompt_lengths [S]
  answer [S]                0 for the main answer, 1..samples for the sampled ones
  num_prompts []            prompts the shard was made from (over-long ones are dropped)
  top_logp [S, T, K] float32, top_ids [S, T, K] int32   with teacher_top_k=K: the target's K
                            most likely next tokens after each position (`teacher.py`), so
                            training runs no teacher LM head
and `manifest.json` lists the shards written so far with their token counts and generation
times (tokens/s). Shards are written to a temp file and renamed, so a re-run skips every
finished shard and regenerates only the missing ones.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.io.files import write_atomic, write_json
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.train.prompts import prompt_text, stable_hash, user
from jetspec_jax.train.teacher import compile_ahead, label_top_k

MANIFEST = "manifest.json"
FORMAT = 1
ARRAYS = ("tokens", "lengths", "prompt_lengths", "top_logp", "top_ids")  # what training reads


class DatasetError(ValueError):
    """Missing, empty or inconsistent training data."""


@dataclasses.dataclass(frozen=True)
class GenSettings:
    """What a dataset directory was generated with; a resumed run must use the same."""

    target: str
    max_prompt_len: int
    max_new: int
    shard_size: int
    sampler: dict
    seed: int
    samples: int = 0
    sample_sampler: dict | None = None
    dtype: str = "float32"
    teacher_top_k: int = 0


def make_dataset(tparams, tcfg: ModelConfig, tokenizer, prompts: Iterable[str | list[dict]],
                 out_dir: str | Path, *, shard_size: int = 1024, max_prompt_len: int = 256,
                 max_new: int = 256, batch_size: int = 32, sampler: Sampler = Sampler(),
                 samples: int = 0, sample_sampler: Sampler = Sampler(temperature=0.8),
                 seed: int = 0, max_seqs: int | None = None, cache_dtype=jnp.float32,
                 teacher_top_k: int = 0, kernels: Kernels = Kernels(),
                 progress: bool = True) -> dict:
    """Regenerates responses to prompts with the target and writes token shards; returns the
    manifest. Prompts whose templated form exceeds max_prompt_len tokens are skipped.
    teacher_top_k > 0 also stores the target's top-K next tokens at every position. kernels:
    the target's while it answers (not a setting of the data: any of them decodes the same
    model)."""
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    if not 0 <= teacher_top_k <= tcfg.vocab_size:
        raise ValueError(f"teacher_top_k must be in [0, {tcfg.vocab_size}], got {teacher_top_k}")
    if samples and sample_sampler.greedy:
        raise ValueError("sampled answers need a temperature > 0 (greedy ones would repeat "
                         "the main answer)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = GenSettings(tcfg.name, max_prompt_len, max_new, shard_size,
                           dataclasses.asdict(sampler), seed, samples,
                           dataclasses.asdict(sample_sampler) if samples else None,
                           jnp.dtype(cache_dtype).name, teacher_top_k)
    old = _read_manifest(out) if (out / MANIFEST).exists() else None
    if old is not None and old["settings"] != dataclasses.asdict(settings):
        raise DatasetError(f"{out} was generated with {old['settings']}, not "
                           f"{dataclasses.asdict(settings)}; use another directory")
    done = {s["file"]: s for s in old["shards"]} if old else {}
    gen = _Generator(tparams, tcfg, settings, batch_size, cache_dtype, kernels,
                     tuple(tokenizer.eos_token_ids or tcfg.eos_token_ids), tokenizer.pad_id)
    answers = [sampler] + [sample_sampler] * samples
    prompts = itertools.islice(prompts, max_seqs)
    shards, made = [], [0, 0.0, 0.0]  # tokens generated by this run, their and the teacher's s
    teacher_timing = {}  # the teacher's compile seconds (within made[2])
    bar = tqdm(desc="self-distillation", unit="prompt", disable=not progress)
    for i, chunk in enumerate(_batched(prompts, shard_size)):
        file = out / f"shard-{i:05d}.npz"
        # A shard is done when it exists for as many prompts (a partial last shard is redone
        # when more prompts come).
        if _shard_prompts(file) != len(chunk) or file.name not in done:
            rows = _rows(tokenizer, chunk, answers, max_prompt_len)
            if teacher_top_k:  # its programs compile while the answers are generated
                compile_ahead(tparams, tcfg, teacher_top_k, max_prompt_len + max_new)
            arrays, new_tokens, seconds = gen(rows)
            if teacher_top_k:
                t = time.perf_counter()
                arrays |= label_top_k(tparams, tcfg, arrays["tokens"], arrays["lengths"],
                                      teacher_top_k, timing=teacher_timing)
                made[2] += time.perf_counter() - t
            write_atomic(file, lambda f: np.savez(f, num_prompts=len(chunk), **arrays))
            entry = {"file": file.name, "num_prompts": len(chunk),
                     "num_seqs": len(rows), "num_tokens": int(arrays["lengths"].sum()),
                     "new_tokens": new_tokens, "seconds": round(seconds, 3)}
            made[0] += new_tokens
            made[1] += seconds
            bar.set_postfix_str(f"{made[0]:,} tokens at {made[0] / max(made[1], 1e-9):,.0f} "
                                f"tokens/s")
        else:
            entry = done[file.name]
        shards.append(entry)
        teacher_compile = teacher_timing.get("compile_seconds", 0.0)
        manifest = _manifest(settings, shards, gen.compile_seconds, made[2] - teacher_compile,
                             teacher_compile, kernels)
        write_json(out / MANIFEST, manifest)
        bar.update(len(chunk))
    bar.close()
    if not shards:
        raise DatasetError("no prompts: the prompt source is empty")
    return manifest


def _manifest(settings: GenSettings, shards: list[dict], compile_seconds: float,
              teacher_seconds: float, teacher_compile_seconds: float, kernels: Kernels) -> dict:
    new = sum(s.get("new_tokens", 0) for s in shards)
    secs = sum(s.get("seconds", 0.0) for s in shards)
    return {"format": FORMAT, "settings": dataclasses.asdict(settings), "shards": shards,
            "num_seqs": sum(s["num_seqs"] for s in shards),
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "generation": {"new_tokens": new, "seconds": round(secs, 3),
                           "tokens_per_s": round(new / secs, 1) if secs else None,
                           "compile_seconds": round(compile_seconds, 3),
                           "teacher_seconds": round(teacher_seconds, 3),
                           "teacher_compile_seconds": round(teacher_compile_seconds, 3),
                           "backend": jax.default_backend(),
                           "attention": kernels.attention_name}}


def _rows(tokenizer, prompts, answers: list[Sampler], max_prompt_len: int) -> list[tuple]:
    """(prompt ids, prompt hash, answer number, sampler) of each answer to each prompt that
    fits max_prompt_len templated tokens."""
    rows = []
    for p in prompts:
        messages = user(p) if isinstance(p, str) else p
        ids = tokenizer.apply_chat_template(messages)
        if 0 < len(ids) <= max_prompt_len:
            h = stable_hash(prompt_text(messages)) >> 33  # 31 bits: a fold_in datum
            rows += [(ids, h, a, s) for a, s in enumerate(answers)]
    return rows


@functools.partial(jax.jit, static_argnums=0)
def row_keys(seed: int, prompt_hashes, answers):
    """[B] keys, one per (prompt, answer number): independent of batch, shard and order."""
    base = jax.random.key(seed)
    return jax.vmap(lambda h, a: jax.random.fold_in(jax.random.fold_in(base, h), a))(
        prompt_hashes, answers)


class _Generator:
    """Batched decoding of (prompt ids, prompt hash, answer number, sampler) rows into a shard's
    arrays, one compiled program per sampler (timed apart from the decoding)."""

    def __init__(self, tparams, tcfg, s: GenSettings, batch_size, cache_dtype, kernels, stop_ids,
                 pad_id):
        self.tparams, self.tcfg, self.s, self.batch_size = tparams, tcfg, s, batch_size
        self.cache_dtype, self.kernels = cache_dtype, kernels
        self.stop_ids, self.pad_id = stop_ids, pad_id
        self.compile_seconds = 0.0

    def __call__(self, rows):
        p, m, pad = self.s.max_prompt_len, self.s.max_new, self.pad_id
        tokens = np.full((len(rows), p + m), pad, np.int32)
        lengths = np.zeros((len(rows),), np.int32)
        seconds = 0.0
        for sampler in dict.fromkeys(r[3] for r in rows):  # each sampler's rows, in order
            index = [i for i, r in enumerate(rows) if r[3] == sampler]
            for start in range(0, len(index), self.batch_size):
                batch = index[start:start + self.batch_size]
                prompt = np.full((self.batch_size, p), pad, np.int32)  # fixed shape
                plen = np.ones((self.batch_size,), np.int32)
                fill = batch + [batch[0]] * (self.batch_size - len(batch))
                keys = row_keys(self.s.seed, jnp.array([rows[i][1] for i in fill], jnp.uint32),
                                jnp.array([rows[i][2] for i in fill], jnp.uint32))
                for b, i in enumerate(batch):
                    prompt[b, :len(rows[i][0])], plen[b] = rows[i][0], len(rows[i][0])
                args = (self.tparams, jnp.asarray(prompt), jnp.asarray(plen), keys)
                run = self._program(sampler, args)
                t = time.perf_counter()
                out = run(*args)
                gen_tok, gen_n = np.asarray(out.tokens), np.asarray(out.num_tokens)
                seconds += time.perf_counter() - t
                for b, i in enumerate(batch):
                    x, n = rows[i][0], int(gen_n[b])
                    tokens[i, :len(x)] = x
                    tokens[i, len(x):len(x) + n] = gen_tok[b, :n]
                    lengths[i] = len(x) + n
        prompt_lengths = np.array([len(r[0]) for r in rows], np.int32)
        arrays = {"tokens": tokens, "lengths": lengths, "prompt_lengths": prompt_lengths,
                  "answer": np.array([r[2] for r in rows], np.int32)}
        return arrays, int((lengths - prompt_lengths).sum()), seconds

    def _program(self, sampler, args):
        static = dict(cfg=self.tcfg, sampler=sampler, loop=Loop(
            max_new=self.s.max_new, num_slots=self.s.max_prompt_len + self.s.max_new + 1,
            stop_ids=self.stop_ids, kernels=self.kernels, cache_dtype=self.cache_dtype))
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        key = (tuple(sorted(static.items(), key=str)), jax.tree.structure(shapes),
               tuple(jax.tree.leaves(shapes)))
        if key not in _PROGRAMS:  # compiled ahead, so that its time is not decoding time
            t = time.perf_counter()
            _PROGRAMS[key] = ar_generate.lower(*args, **static).compile()
            self.compile_seconds += time.perf_counter() - t
        return _PROGRAMS[key]


_PROGRAMS = {}  # compiled generation programs, shared by every dataset made in this process


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
    """All shards listed in the manifest, concatenated: tokens [S, T], lengths, prompt_lengths,
    and top_logp, top_ids when the data was made with a teacher top-K. Sequences without a
    response token to learn from (length - prompt < 2) are dropped."""
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
            parts.append({k: z[k] for k in ARRAYS if k in z})
    if not parts:
        raise DatasetError(f"{data_dir} holds no shards")
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    keep = data["lengths"] - data["prompt_lengths"] >= 2
    data = {k: v[keep] for k, v in data.items()}
    if not len(data["lengths"]):
        raise DatasetError(f"{data_dir} has no sequence with at least 2 response tokens")
    return data


def _answer_tokens(data: dict) -> np.ndarray:
    """The answer tokens of data (positions prompt_length..length-1 of each row), flat."""
    pos = np.arange(data["tokens"].shape[1])[None, :]
    answer = (pos >= data["prompt_lengths"][:, None]) & (pos < data["lengths"][:, None])
    return np.asarray(data["tokens"])[answer]


def frequent_tokens(data: dict, size: int, vocab_size: int, always=()) -> tuple[int, ...]:
    """A draft vocabulary: the ids in always (the stop tokens), then the answers' most frequent
    tokens (ties to the lower id; unseen ones in id order), `size` in all, sorted."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = np.bincount(_answer_tokens(data), minlength=vocab_size)
    first = list(dict.fromkeys(int(i) for i in always))[:size]
    counts[first] = -1
    rest = np.argsort(-counts, kind="stable")[:size - len(first)]
    return tuple(sorted(first + [int(i) for i in rest]))


def covering_size(data: dict, share: float, vocab_size: int, multiple: int = 1024) -> int:
    """The fewest most-frequent tokens that cover `share` of the answer tokens in data, rounded
    up to a multiple of `multiple` (matmul-friendly widths), at most vocab_size."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"draft vocabulary coverage must be in (0, 1], got {share}")
    counts = np.sort(np.bincount(_answer_tokens(data), minlength=vocab_size))[::-1]
    need = int(np.searchsorted(np.cumsum(counts), share * counts.sum() - 1e-9)) + 1
    return min(-(-need // multiple) * multiple, vocab_size)


def vocab_coverage(data: dict, ids) -> float:
    """Share of the answer tokens in data whose id is in ids."""
    tokens = _answer_tokens(data)
    return float(np.isin(tokens, np.asarray(ids)).mean()) if tokens.size else 0.0
