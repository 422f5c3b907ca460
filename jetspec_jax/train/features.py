"""Cached teacher features: the frozen target run once over a dataset, for training without it.

    cache_features(tparams, tcfg, "data/train", "data/train-feat", tap_layers=dcfg.tap_layers)
    train(TrainConfig(data_dir="data/train", feature_dir="data/train-feat", ...), tparams, tcfg)

The target's training-time outputs do not depend on the head, so instead of recomputing them at
every step (the dominant cost on CPU) they are computed once per sequence. Sequences are run in
length buckets (sorted by length, padded to a multiple of `bucket`), which wastes little compute
on padding; causal attention makes the padded run equal to the unpadded one. Per data shard
`shard-00000.npz` the cache holds a directory `shard-00000/` of .npy files (memory-mapped when
loaded):
  tokens [S, T] int32, lengths [S], prompt_lengths [S]   copied from the data shard
  taps [S, T, k*D]           outputs of the tap layers (`target.forward(..., taps=...)`)
  top_logp [S, T, K]         the target's K most likely next tokens after position t: their
  top_ids [S, T, K] int32    log-probs (from the full log-softmax) and ids, most likely first
(zeros past each sequence's length) and `manifest.json` the settings and the shards done. A
shard is written to a temp directory and renamed: a re-run skips finished shards and caches
only new or changed ones (a data shard regenerated since is redone).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jetspec_jax.io.files import write_json
from jetspec_jax.model import target
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.train.data import MANIFEST, DatasetError, _read_manifest
from jetspec_jax.train.head_forward import target_pass
from jetspec_jax.train.teacher import top_k_teacher, width_batches

FEATURE_FORMAT = 1
ARRAYS = ("tokens", "lengths", "prompt_lengths", "taps", "top_logp", "top_ids")


class FeatureCacheError(DatasetError):
    """A feature cache that is missing, incomplete or made for another target / head."""


def _settings(tcfg: ModelConfig, tap_layers, top_k: int, dtype) -> dict:
    return {"target": tcfg.name, "hidden_size": int(tcfg.hidden_size),
            "vocab_size": int(tcfg.vocab_size), "num_layers": int(tcfg.num_layers),
            "tap_layers": [int(i) for i in tap_layers], "top_k": int(top_k),
            "dtype": np.dtype(dtype).name}


def _shard_digest(file: Path) -> str:
    """sha256 of a data shard's token arrays: ties a cached shard to the data it was made of."""
    if not file.exists():
        raise DatasetError(f"{file} is listed in the manifest but missing")
    h = hashlib.sha256()
    with np.load(file) as z:
        for k in ("tokens", "lengths", "prompt_lengths"):
            h.update(np.ascontiguousarray(z[k]).tobytes())
    return h.hexdigest()


def cache_features(tparams, tcfg: ModelConfig, data_dir: str | Path, out_dir: str | Path, *,
                   tap_layers, top_k: int = 64, batch_size: int = 8, dtype=np.float16,
                   bucket: int = 64, max_shards: int | None = None,
                   progress: bool = True) -> dict:
    """Runs the target once over every sequence of the shards in data_dir's manifest (the first
    `max_shards` of them) and writes their features under out_dir; returns the manifest."""
    data_dir, out = Path(data_dir), Path(out_dir)
    if not (data_dir / MANIFEST).exists():
        raise DatasetError(f"{data_dir} has no {MANIFEST}: not a dataset made by make_dataset")
    data_manifest = _read_manifest(data_dir)
    shards = data_manifest["shards"][:max_shards]
    if not shards:
        raise DatasetError(f"{data_dir} holds no shards")
    tap_layers = tuple(int(i) for i in tap_layers)
    if not tap_layers or min(tap_layers) < 0 or max(tap_layers) >= tcfg.num_layers:
        raise ValueError(f"tap_layers {tap_layers} must be layers of the {tcfg.num_layers}-layer "
                         f"target")
    if not 1 <= top_k <= tcfg.vocab_size:
        raise ValueError(f"top_k must be in [1, {tcfg.vocab_size}], got {top_k}")
    settings = _settings(tcfg, tap_layers, top_k, dtype)
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    if (out / MANIFEST).exists():
        old = _read_feature_manifest(out)
        if old["settings"] != settings:
            raise FeatureCacheError(f"{out} caches features {old['settings']}, not {settings}; "
                                    f"use another directory")
        if old["data_settings"] != data_manifest["settings"]:
            raise FeatureCacheError(f"{out} caches a dataset generated with "
                                    f"{old['data_settings']}, not {data_dir}'s "
                                    f"{data_manifest['settings']}; use another directory")
        done = {s["file"]: s for s in old["shards"]}

    @jax.jit
    def run(tokens):
        hidden, taps = target_pass(tparams, tcfg, tokens, tap_layers)
        top_logp, top_ids = top_k_teacher(target.lm_head(tparams, tcfg, hidden), top_k)
        return taps.astype(dtype), top_logp.astype(dtype), top_ids

    total = sum(s["num_tokens"] for s in shards)
    bar = tqdm(total=total, desc="cache features", unit="tok", unit_scale=True,
               disable=not progress)
    entries, t0, computed = [], time.time(), 0
    for shard in shards:
        name = shard["file"]
        entry = {"file": name, "dir": Path(name).stem, "num_seqs": shard["num_seqs"],
                 "num_tokens": shard["num_tokens"], "num_prompts": shard["num_prompts"],
                 "sha256": _shard_digest(data_dir / name)}
        if done.get(name) != entry or not (out / entry["dir"]).is_dir():
            _cache_shard(run, data_dir / name, out / entry["dir"], settings, tcfg, batch_size,
                         bucket)
            computed += shard["num_tokens"]
        entries.append(entry)
        # Shards cached by an earlier run but not asked for now stay listed (max_shards).
        listed = entries + [s for f, s in done.items() if f not in {e["file"] for e in entries}]
        manifest = {"format": FEATURE_FORMAT, "settings": settings,
                    "data_dir": str(data_dir.resolve()),
                    "data_settings": data_manifest["settings"], "shards": listed,
                    "num_seqs": sum(s["num_seqs"] for s in listed),
                    "num_tokens": sum(s["num_tokens"] for s in listed)}
        write_json(out / MANIFEST, manifest)
        bar.update(shard["num_tokens"])
    bar.close()
    manifest["seconds"] = time.time() - t0
    manifest["computed_tokens"] = computed
    return manifest


def _cache_shard(run, file: Path, dest: Path, settings: dict, tcfg, batch_size: int,
                 bucket: int) -> None:
    if not file.exists():
        raise DatasetError(f"{file} is listed in the manifest but missing")
    with np.load(file) as z:
        tokens, lengths, plens = z["tokens"], z["lengths"], z["prompt_lengths"]
    n, t = tokens.shape
    kd = len(settings["tap_layers"]) * settings["hidden_size"]
    k, dt = settings["top_k"], np.dtype(settings["dtype"])
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        np.save(tmp / "tokens.npy", tokens)
        np.save(tmp / "lengths.npy", lengths)
        np.save(tmp / "prompt_lengths.npy", plens)
        mm = lambda name, shape, d: np.lib.format.open_memmap(  # noqa: E731
            tmp / f"{name}.npy", mode="w+", dtype=d, shape=shape)
        taps, top_logp, top_ids = (mm("taps", (n, t, kd), dt), mm("top_logp", (n, t, k), dt),
                                   mm("top_ids", (n, t, k), np.int32))
        for rows, batch in width_batches(tokens, lengths, batch_size * t, bucket):
            out = jax.device_get(run(jnp.asarray(batch)))
            for i, r in enumerate(rows):
                m = int(lengths[r])
                taps[r, :m], top_logp[r, :m], top_ids[r, :m] = (x[i, :m] for x in out)
        for a in (taps, top_logp, top_ids):
            a.flush()
        del taps, top_logp, top_ids
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_feature_manifest(feature_dir: Path) -> dict:
    try:
        manifest = json.loads((feature_dir / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise FeatureCacheError(f"{feature_dir / MANIFEST} is corrupt: {e}") from e
    if manifest.get("format") != FEATURE_FORMAT or "settings" not in manifest:
        raise FeatureCacheError(f"{feature_dir / MANIFEST} is not a feature cache manifest "
                                f"(format {manifest.get('format')}, expected {FEATURE_FORMAT})")
    return manifest


def load_features(feature_dir: str | Path, tcfg: ModelConfig, tap_layers, *,
                  data_dir: str | Path | None = None) -> dict[str, np.ndarray]:
    """The cached shards, concatenated (taps / top-k memory-mapped when there is one shard,
    else read into memory): tokens, lengths, prompt_lengths, taps, top_logp, top_ids. Checks
    that the cache was made by this target with these tap layers and, given data_dir, from that
    dataset (fewer cached shards than the dataset holds only warns). Sequences are filtered as
    in `load_shards`."""
    feature_dir = Path(feature_dir)
    if not (feature_dir / MANIFEST).exists():
        raise FeatureCacheError(f"no feature cache at {feature_dir} (no {MANIFEST}): run "
                                f"cache_features first")
    manifest = _read_feature_manifest(feature_dir)
    s = manifest["settings"]
    want = {"target": tcfg.name, "hidden_size": int(tcfg.hidden_size),
            "vocab_size": int(tcfg.vocab_size), "num_layers": int(tcfg.num_layers),
            "tap_layers": [int(i) for i in tap_layers]}
    wrong = {k: (s.get(k), v) for k, v in want.items() if s.get(k) != v}
    if wrong:
        raise FeatureCacheError(
            f"{feature_dir} was cached for another target or head: "
            + ", ".join(f"{k} is {got} there, {w} here" for k, (got, w) in wrong.items())
            + "; re-run cache_features for this one")
    shards = manifest["shards"]
    if data_dir is not None:
        data_manifest = _read_manifest(Path(data_dir))
        if data_manifest["settings"] != manifest["data_settings"]:
            raise FeatureCacheError(f"{feature_dir} caches a dataset generated with "
                                    f"{manifest['data_settings']}, not {data_dir}'s")
        data_shards = {d["file"]: d for d in data_manifest["shards"]}
        for e in shards:
            if e["file"] not in data_shards or _shard_digest(
                    Path(data_dir) / e["file"]) != e["sha256"]:
                raise FeatureCacheError(f"{feature_dir}/{e['dir']} does not match {data_dir}'s "
                                        f"{e['file']} (other data, or regenerated?): re-run cache_features")
        missing = len(data_shards) - len(shards)
        if missing > 0:
            warnings.warn(f"{feature_dir} caches {len(shards)} of the {len(data_shards)} shards "
                          f"of {data_dir}; training uses only the cached ones", stacklevel=2)
    parts = []
    for e in sorted(shards, key=lambda e: e["file"]):
        d = feature_dir / e["dir"]
        if not d.is_dir():
            raise FeatureCacheError(f"{d} is listed in the manifest but missing")
        parts.append({k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ARRAYS})
    if not parts:
        raise FeatureCacheError(f"{feature_dir} holds no shards")
    if len(parts) == 1:
        data = dict(parts[0])
    else:
        data = {k: np.concatenate([p[k] for p in parts]) for k in ARRAYS}
    keep = np.asarray(data["lengths"] - data["prompt_lengths"] >= 2)
    if not keep.all():
        data = {k: v[keep] for k, v in data.items()}
    if not len(data["lengths"]):
        raise FeatureCacheError(f"{feature_dir} has no sequence with at least 2 response tokens")
    return data
