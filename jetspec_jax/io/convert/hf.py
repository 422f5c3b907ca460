"""HF safetensors checkpoints (Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM) -> our
params tree (layout in `jetspec_jax.model.params`).

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints are
read lazily with `safe_open`, one tensor at a time, so converting needs about one copy of the
weights in memory. HF Linear weights are `[out, in]`; ours are `[in..., out...]`.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jetspec_jax.io.convert.common import ConversionError, Rule, convert_tensors
from jetspec_jax.model.config import ModelConfig, load_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"



def decoder_layer_rules(prefix: str) -> list[Rule]:
    """Rules for the HF Qwen3 / Llama decoder-layer tensors named `{prefix}layers.{i}.*`
    (the target's, with prefix "model.", and the reference draft head's, with none)."""
    lyr = re.escape(prefix) + r"layers\.(\d+)\."
    return [
        Rule(lyr + r"input_layernorm\.weight", "layers/{0}/attn_norm"),
        Rule(lyr + r"self_attn\.q_proj\.weight", "layers/{0}/q", "linear"),
        Rule(lyr + r"self_attn\.k_proj\.weight", "layers/{0}/k", "linear"),
        Rule(lyr + r"self_attn\.v_proj\.weight", "layers/{0}/v", "linear"),
        Rule(lyr + r"self_attn\.o_proj\.weight", "layers/{0}/o", "linear"),
        Rule(lyr + r"self_attn\.q_norm\.weight", "layers/{0}/q_norm"),
        Rule(lyr + r"self_attn\.k_norm\.weight", "layers/{0}/k_norm"),
        Rule(lyr + r"post_attention_layernorm\.weight", "layers/{0}/mlp_norm"),
        Rule(lyr + r"mlp\.gate_proj\.weight", "layers/{0}/gate", "linear"),
        Rule(lyr + r"mlp\.up_proj\.weight", "layers/{0}/up", "linear"),
        Rule(lyr + r"mlp\.down_proj\.weight", "layers/{0}/down", "linear"),
    ]


_E = r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
RULES = [
    Rule(r"model\.embed_tokens\.weight", "embed"),
    Rule(r"model\.norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head", "linear"),
    *decoder_layer_rules("model."),
    Rule(r"model\.layers\.(\d+)\.mlp\.gate\.weight", "layers/{0}/router", "linear"),
    Rule(_E + r"gate_proj\.weight", "layers/{0}/gate", "linear", expert_group=2),
    Rule(_E + r"up_proj\.weight", "layers/{0}/up", "linear", expert_group=2),
    Rule(_E + r"down_proj\.weight", "layers/{0}/down", "linear", expert_group=2),
]
# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_dir(path: str | Path) -> Path:
    """The HF checkpoint directory for a directory or a file inside one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such HF checkpoint: {path}")
    return path if path.is_dir() else path.parent


def is_hf_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.name.endswith((".safetensors", INDEX_FILE))
    return path.is_dir() and ((path / SINGLE_FILE).exists() or (path / INDEX_FILE).exists())


def load_hf(path: str | Path, *, dtype=jnp.bfloat16, name: str | None = None,
            progress: bool = True) -> tuple[ModelConfig, dict]:
    """Converts the HF checkpoint at `path` (its dir, or a file in it) -> (config, params)."""
    root = checkpoint_dir(path)
    if not (root / "config.json").exists():
        raise FileNotFoundError(f"HF checkpoint {root} has no config.json")
    cfg = load_hf_config(root, name=name or root.name)
    weight_map, problems = _weight_map(root), []
    with contextlib.ExitStack() as stack:
        handles = {f: _open(root / f, stack) for f in sorted(set(weight_map.values()))}
        held = {f: set(h.keys()) for f, h in handles.items()}
        present = {k for k, f in weight_map.items() if k in held[f]}
        problems += [f"{INDEX_FILE} puts {k} in {weight_map[k]}, which does not hold it"
                     for k in sorted(set(weight_map) - present)]

        def read(key: str) -> np.ndarray:
            try:
                return handles[weight_map[key]].get_tensor(key)
            except SafetensorError as e:
                raise ConversionError(f"{root / weight_map[key]}: cannot read {key}: {e}") from e

        ignore = {k for k in present if k.endswith(_IGNORED_SUFFIXES)}
        if cfg.tie_embeddings and "lm_head.weight" in present:
            ignore.add("lm_head.weight")  # tied: the embedding is the head
            if "model.embed_tokens.weight" in present and not np.array_equal(
                read("lm_head.weight"), read("model.embed_tokens.weight")
            ):
                problems.append("lm_head.weight differs from model.embed_tokens.weight although "
                                "the config ties the embeddings (tie_word_embeddings)")
        params = convert_tensors(cfg, RULES, present, read, dtype=dtype,
                                 what=f"HF checkpoint {root}", ignore=ignore, problems=problems,
                                 progress=progress)
    return cfg, params


def _weight_map(root: Path) -> dict[str, str]:
    """key -> file name, from the index or the single file."""
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index} is not a valid safetensors index: {e!r}") from e
        missing = sorted({f for f in weight_map.values() if not (root / f).exists()})
        if missing:
            raise ConversionError(f"{index} names shard files that are missing: {missing}")
        return dict(weight_map)
    single = root / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"HF checkpoint {root} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with contextlib.ExitStack() as stack:
        return {k: SINGLE_FILE for k in _open(single, stack).keys()}


def _open(file: Path, stack: contextlib.ExitStack):
    try:
        return stack.enter_context(safe_open(file, framework="numpy"))
    except (SafetensorError, OSError) as e:
        raise ConversionError(
            f"{file} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from e
