"""Draft-head checkpoints: the reference's released format in, our orbax format in and out.

Two formats:

* The reference's (`DFlashDraftModel.save_pretrained`): an HF-style directory with
  `config.json`, a Qwen3 config of the head's own decoder layers (`num_hidden_layers` is the
  number of DRAFT layers) plus `block_size`, `num_target_layers` and
  `dflash_config` = {causal_head, target_layer_ids, mask_token_id, target_hidden_size}, and
  `model.safetensors` (or an index + shards) holding

      fc.weight [D, k*D]       hidden_norm.weight [D]       norm.weight [D]
      layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
      layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
      layers.{i}.mlp.{gate,up,down}_proj.weight

  The head owns neither an embedding nor an LM head: it embeds [anchor, MASK...] with the
  target's embedding (so `mask_token_id` is required) and decodes with the target's LM head.
  A missing `target_layer_ids` means k = num_hidden_layers ids spread over [1, L-3] of the
  L = num_target_layers target layers (`default_tap_layers(L, num_hidden_layers)`), and a
  missing `causal_head` means a bidirectional block (the DFlash baseline).

* Ours: `checkpoint.save_tree` with kind "draft_head" and `DraftConfig.to_dict()` as the
  config, params laid out as `draft_head.draft_specs`; or the same tree and config as a few
  flat safetensors files of bounded size (`shards.py`: `save_draft(..., max_bytes=...)`),
  for a head that must travel as small files.

    dcfg, params = read_any_draft("path/to/head", dtype=jnp.bfloat16, target=tcfg)
    save_draft("checkpoints/head", params, dcfg)
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError

from jetspec_jax.io.checkpoints import (CheckpointError, carried_metadata, load_tree, read_info,
                                    save_tree, stored_shapes)
from jetspec_jax.draft.head import DraftConfig, default_tap_layers, draft_specs
from jetspec_jax.io.convert import hf
from jetspec_jax.io.convert.common import ConversionError, Rule, convert_tensors
from jetspec_jax.io.shards import is_shard_export, read_shards, save_shards
from jetspec_jax.model.config import ConfigError, ModelConfig, from_hf_config
from jetspec_jax.model.params import check_params, unflatten

__all__ = [
    "KIND", "CheckpointError", "ConversionError", "convert_head",
    "head_config_from_reference", "is_reference_head", "read_any_draft", "read_draft_checkpoint",
    "load_reference_head", "save_draft",
]

KIND = "draft_head"
_ACCEPTED = ("a jetspec_jax draft-head checkpoint (save_draft: a directory, or its safetensors "
             "files) or a reference draft-head directory (config.json with dflash_config + "
             "model.safetensors)")

# --- reference tensors -> our leaves -------------------------------------------------------
# `convert_tensors` builds trees shaped like `params.target_specs`, so the head is converted
# in two parts, each through a target-shaped stand-in config whose leaves have the head's
# shapes:
#   top:    vocab k*D, no layers, tied:  "embed" [k*D, D] <- fc.weight [D, k*D] (an HF Linear),
#                                         "final_norm" [D] <- hidden_norm.weight
#   layers: the head's layers, tied:     "layers" as in a Qwen3 target, "final_norm" <- norm.weight
#           ("embed" is marked as provided, through a key no file can hold, so it is not missed)
_TOP_RULES = [
    Rule(r"fc\.weight", "embed", "linear"),
    Rule(r"hidden_norm\.weight", "final_norm"),
]
_TOP_NAMES = {"embed": "fc", "final_norm": "hidden_norm"}
_NO_EMBED = "<the target's embedding>"
_LAYER_RULES = [
    *hf.decoder_layer_rules(""),
    Rule(r"norm\.weight", "final_norm"),
    Rule(_NO_EMBED, "embed"),
]
_LAYER_NAMES = {"final_norm": "norm"}

# Keys of the reference config.json that must be there (Qwen3Config would otherwise fill in
# the defaults of an unrelated model); optional ones get Qwen3Config's defaults.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
             "intermediate_size", "block_size", "num_target_layers")
_OPTIONAL_INTS = ("num_key_value_heads", "vocab_size", "max_position_embeddings")
_SAFETENSORS_DTYPES = {"BF16": jnp.bfloat16, "F16": jnp.float16, "F32": jnp.float32,
                       "F64": jnp.float64}


# --- the reference format -------------------------------------------------------------------

def is_reference_head(path: str | Path) -> bool:
    """Whether path is a directory whose config.json describes a reference draft head."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and _looks_like_head(config)


def _looks_like_head(config: dict) -> bool:
    return "dflash_config" in config or "block_size" in config


def head_config_from_reference(config: dict[str, Any], *, name: str = "draft-head",
                               where: str = "config.json") -> DraftConfig:
    """The reference head's config.json dict -> our DraftConfig; one CheckpointError lists
    every problem. The head's `layers.vocab_size` is the config's vocab_size, 0 if absent."""
    problems = []
    for key in _REQUIRED:
        if key not in config:
            problems.append(f"no {key}")
        elif not _positive_int(config[key]):
            problems.append(f"{key} must be a positive integer, got {config[key]!r}")
    for key in _OPTIONAL_INTS:
        if config.get(key) is not None and not _positive_int(config[key]):
            problems.append(f"{key} must be a positive integer, got {config[key]!r}")
    dflash = config.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        problems.append(f"dflash_config must be an object, got {dflash!r}")
        dflash = {}
    mask = dflash.get("mask_token_id")
    if mask is None:
        problems.append("missing mask token: dflash_config has no mask_token_id (the head "
                        "embeds its MASK slots with the target's embedding of that token)")
    elif not _int(mask) or mask < 0:
        problems.append(f"mask_token_id must be a non-negative integer, got {mask!r}")
    if _positive_int(config.get("block_size")) and config["block_size"] < 2:
        problems.append(f"block_size must be >= 2, got {config['block_size']}")
    problems += _unsupported(config, dflash)

    num_target = config.get("num_target_layers")
    taps = dflash.get("target_layer_ids")
    if taps is None:  # the reference spreads one tap per DRAFT layer
        if _positive_int(num_target) and _positive_int(config.get("num_hidden_layers")):
            taps = default_tap_layers(num_target, config["num_hidden_layers"])
    elif not isinstance(taps, list) or not taps or not all(_int(i) for i in taps):
        problems.append(f"target_layer_ids must be a non-empty list of integers, got {taps!r}")
    elif _positive_int(num_target) and (bad := [i for i in taps if not 0 <= i < num_target]):
        problems.append(f"target_layer_ids {bad} are outside the {num_target} target layers "
                        f"0..{num_target - 1}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))

    try:  # the Qwen3 part: rope theta, eps, biases, rope scaling, GQA checks
        layers = from_hf_config({**config, "architectures": ["Qwen3ForCausalLM"],
                                 "vocab_size": config.get("vocab_size") or 0}, name=name)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: not a usable Qwen3 draft-layer config: {e}") from e
    layers = layers.replace(qk_norm=True, tie_embeddings=False)
    return DraftConfig(layers=layers, block_size=config["block_size"],
                       tap_layers=tuple(int(i) for i in taps), mask_token_id=int(mask),
                       causal=bool(dflash.get("causal_head", False)),
                       num_target_layers=num_target)


def _unsupported(config: dict, dflash: dict) -> list[str]:
    """Reference-head features our draft head does not implement."""
    problems = []
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r} is not supported (only silu)")
    types = config.get("layer_types")
    if types is None and config.get("use_sliding_window") and config.get("sliding_window"):
        first = config.get("max_window_layers", 28)  # Qwen3Config's rule without layer_types
        types = ["sliding_attention"] * max(0, config.get("num_hidden_layers", 0) - first)
    if "sliding_attention" in (types or ()):
        problems.append("sliding-window attention is not supported")
    rope = config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") not in (None, "default"):
        problems.append(f"rope_parameters {rope!r} are not supported (only default rope)")
    th = dflash.get("target_hidden_size")
    if th is not None and th != config.get("hidden_size"):
        problems.append(f"target_hidden_size {th} != hidden_size {config.get('hidden_size')}: "
                        "the reference's random-init hidden-size adapter is not supported")
    return problems


def load_reference_head(path: str | Path, *, dtype=None, progress: bool = False
                        ) -> tuple[DraftConfig, dict]:
    """A reference draft-head directory (or a file in it) -> (DraftConfig, params).

    dtype: of every array; None keeps the stored one (float32 if the file mixes dtypes).
    Raises FileNotFoundError for a missing directory or file, CheckpointError for a config
    that is not a usable head's (no mask token included), ConversionError listing every
    missing, unexpected and mis-shaped tensor.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no draft head at {path}: no such file or directory")
    root = path if path.is_dir() else path.parent
    config_file = root / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"draft head {root} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file} is corrupt (not valid JSON): {e}") from e
    if not isinstance(config, dict) or not _looks_like_head(config):
        raise CheckpointError(f"{root} is not a draft-head checkpoint: its config.json has "
                              "neither dflash_config nor block_size (a target model?)")
    dcfg = head_config_from_reference(config, name=root.name, where=str(config_file))
    if not (root / hf.SINGLE_FILE).exists() and not (root / hf.INDEX_FILE).exists():
        raise FileNotFoundError(f"draft head {root} has no weights: neither {hf.SINGLE_FILE} "
                                f"nor {hf.INDEX_FILE}")
    weight_map = hf._weight_map(root)
    with contextlib.ExitStack() as stack:
        handles = {f: hf._open(root / f, stack) for f in sorted(set(weight_map.values()))}
        held = {f: set(h.keys()) for f, h in handles.items()}
        missing = sorted(k for k, f in weight_map.items() if k not in held[f])
        if missing:
            raise ConversionError(f"{root / hf.INDEX_FILE} names tensors its shards do not "
                                  f"hold: {missing}")

        def read(key: str) -> np.ndarray:
            try:
                return handles[weight_map[key]].get_tensor(key)
            except SafetensorError as e:
                raise ConversionError(f"{root / weight_map[key]}: cannot read {key}: {e}") from e

        if dtype is None:
            stored = {handles[f].get_slice(k).get_dtype() for k, f in weight_map.items()}
            dtype = _SAFETENSORS_DTYPES.get(stored.pop(), jnp.float32) if len(stored) == 1 \
                else jnp.float32
        keys = [k for k in weight_map if not k.endswith(hf._IGNORED_SUFFIXES)]
        params = _convert(dcfg, keys, read, dtype, f"draft head {root}", progress)
    check_params(params, draft_specs(dcfg), f"draft head {root}")  # by construction
    return dcfg, params


def _convert(dcfg: DraftConfig, keys, read, dtype, what: str, progress: bool) -> dict:
    d = dcfg.layers.hidden_size
    k = len(dcfg.tap_layers)
    top_cfg = ModelConfig(name="draft-head-top", vocab_size=k * d, hidden_size=d, num_layers=0,
                          num_heads=1, num_kv_heads=1, head_dim=1, intermediate_size=0,
                          tie_embeddings=True)
    layers_cfg = dcfg.layers.replace(tie_embeddings=True)
    top_keys = [key for key in keys if any(r.match(key) for r in _TOP_RULES)]
    rest_keys = [key for key in keys if key not in top_keys]
    problems, top, rest = [], None, None
    try:
        top = convert_tensors(top_cfg, _TOP_RULES, top_keys, read, dtype=dtype, what=what,
                              progress=progress)
    except ConversionError as e:
        problems += _problem_lines(e, _TOP_NAMES)
    try:
        rest = convert_tensors(layers_cfg, _LAYER_RULES, rest_keys, read, dtype=dtype,
                               what=what, ignore=[_NO_EMBED], progress=progress)
    except ConversionError as e:
        problems += _problem_lines(e, _LAYER_NAMES)
    if problems:
        raise ConversionError(f"cannot load {what}:\n  " + "\n  ".join(problems))
    return {"fc": top["embed"], "hidden_norm": top["final_norm"], "layers": rest["layers"],
            "norm": rest["final_norm"]}


def _problem_lines(error: ConversionError, names: dict[str, str]) -> list[str]:
    """The problem lines of a convert_tensors error, with the stand-in leaf names of
    "missing tensor <leaf> (<source key>)" replaced by ours (other lines name source keys)."""
    lines = []
    for line in (line.strip() for line in str(error).splitlines()[1:]):
        leaf, sep, tail = line.removeprefix("missing tensor ").partition(" ")
        if line.startswith("missing tensor ") and leaf in names:
            line = f"missing tensor {names[leaf]}{sep}{tail}"
        lines.append(line)
    return lines


# --- our format ------------------------------------------------------------------------------

def save_draft(path: str | Path, params, dcfg: DraftConfig, *,
               metadata: dict[str, Any] | None = None, overwrite: bool = False,
               max_bytes: int | None = None, dtype=None) -> Path:
    """Writes our draft-head checkpoint; nothing is left at path unless it all succeeds.
    max_bytes: as flat safetensors files of at most that size (`shards.py`) instead of orbax.
    dtype: cast the arrays first (e.g. bfloat16 to ship a head trained in float32)."""
    check_params(params, draft_specs(dcfg), "draft-head params to save")
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    if max_bytes is not None:
        return save_shards(path, params, dcfg.to_dict(), kind=KIND, metadata=metadata,
                           max_bytes=max_bytes, overwrite=overwrite)
    return save_tree(path, params, dcfg.to_dict(), kind=KIND, metadata=metadata,
                     overwrite=overwrite)


def read_draft_shards(paths, *, dtype=None) -> tuple[DraftConfig, dict, dict]:
    """A `save_draft(max_bytes=...)` export (its directory or its files) -> (DraftConfig,
    params, metadata)."""
    kind, config, flat, meta = read_shards(paths)
    if kind != KIND:
        raise CheckpointError(f"{paths} hold a {kind!r} head, not a {KIND!r}")
    try:
        dcfg = DraftConfig.from_dict(config)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{paths}: not a valid draft-head config: {e!r}") from e
    return dcfg, unflatten(flat, draft_specs(dcfg), f"draft head {paths}", dtype), meta


def read_draft_checkpoint(path: str | Path, *, dtype=None) -> tuple[DraftConfig, dict]:
    """Our draft-head checkpoint -> (DraftConfig, params); dtype None keeps the stored one."""
    path = Path(path).absolute()
    config, _ = read_info(path, KIND)
    try:
        dcfg = DraftConfig.from_dict(config)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json is not a valid draft-head config: "
                              f"{e!r}") from e
    shapes = stored_shapes(path)
    check_params(shapes, draft_specs(dcfg), f"draft-head checkpoint {path}")
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, dtype or m.dtype), shapes)
    params, _, _ = load_tree(path, abstract, kind=KIND)
    return dcfg, params


# --- either ---------------------------------------------------------------------------------

def read_any_draft(path: str | Path, *, dtype=None, target: ModelConfig | None = None,
                   progress: bool = False) -> tuple[DraftConfig, dict]:
    """Our checkpoint or a reference head directory -> (DraftConfig, params), checked
    against the target config when one is given."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no draft head at {path}: no such file or directory; "
                                f"expected {_ACCEPTED}")
    root = path if path.is_dir() else path.parent
    if (root / "metadata.json").exists():
        dcfg, params = read_draft_checkpoint(root, dtype=dtype)
    elif is_shard_export(path):
        dcfg, params, _ = read_draft_shards(path, dtype=dtype)
    elif (root / "config.json").exists():
        dcfg, params = load_reference_head(root, dtype=dtype, progress=progress)
    else:
        raise CheckpointError(f"cannot tell what {path} is; expected {_ACCEPTED}")
    if target is not None:
        dcfg.check_target(target)
    return dcfg, params


def convert_head(src: str | Path, dst: str | Path, *, dtype=None, overwrite: bool = False,
                 progress: bool = False, metadata: dict[str, Any] | None = None,
                 max_bytes: int | None = None) -> Path:
    """A reference head directory or one of ours (e.g. a trained head in float32, to ship in
    bfloat16) -> our checkpoint at dst (written atomically). Our own head's metadata (its
    training settings) is kept; `metadata` adds to it."""
    dcfg, params = read_any_draft(src, dtype=dtype, progress=progress)
    root = Path(src) if Path(src).is_dir() else Path(src).parent
    kept = carried_metadata(root, KIND) if (root / "metadata.json").exists() else {}
    if is_shard_export(src):
        kept = read_shards(src)[3]
    return save_draft(dst, params, dcfg, metadata={**kept, "source": str(src), **(metadata or {})},
                      overwrite=overwrite, max_bytes=max_bytes)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive_int(x) -> bool:
    return _int(x) and x > 0
