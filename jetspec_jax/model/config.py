"""Frozen model configs for the Qwen3 family (dense, MoE) and Llama-architecture models.

Shape alphabet used across the package:
  B batch, T query tokens / tree nodes, S cache slots, N query heads, K KV heads,
  H head dim, D model width, F MLP width, E experts, V vocab, L layers.
Configs are frozen and hashable so they can be passed to `jax.jit` as static arguments.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}


class ConfigError(ValueError):
    """A model config that this library cannot serve."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    intermediate_size: int  # F (dense MLP)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True  # Qwen3 normalises q and k per head; Llama does not.
    tie_embeddings: bool = False
    max_position_embeddings: int = 40_960
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means a dense model.
    num_experts: int = 0  # E
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] | None = None  # None: every layer is MoE when num_experts > 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"{self.name}: experts_per_token={self.experts_per_token} must be in "
                f"[1, num_experts={self.num_experts}]"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        if not self.is_moe:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        # older checkpoints store matmul_impl: the kernels are chosen per run now (`kernels`)
        data = {k: v for k, v in data.items() if k != "matmul_impl"}
        unknown = set(data) - fields
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        for key in ("eos_token_ids", "moe_layers"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def qwen3_8b() -> ModelConfig:
    return ModelConfig(
        name="qwen3-8b", vocab_size=151_936, hidden_size=4096, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=12_288, eos_token_ids=(151_645, 151_643),
    )


def qwen3_30b_a3b() -> ModelConfig:
    return ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151_936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
        experts_per_token=8, moe_intermediate_size=768, eos_token_ids=(151_645, 151_643),
    )


def smollm2_135m() -> ModelConfig:
    return ModelConfig(
        name="smollm2-135m", vocab_size=49_152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100_000.0,
        rms_norm_eps=1e-5, qk_norm=False, tie_embeddings=True, max_position_embeddings=8192,
        eos_token_ids=(2,),
    )


def tiny_dense(**changes: Any) -> ModelConfig:
    """A few-layer Qwen3-style model for tests."""
    base = ModelConfig(
        name="tiny-dense", vocab_size=128, hidden_size=64, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96, rope_theta=10_000.0,
        max_position_embeddings=512,
    )
    return base.replace(**changes)


def tiny_moe(**changes: Any) -> ModelConfig:
    base = tiny_dense(name="tiny-moe", num_experts=8, experts_per_token=2, moe_intermediate_size=32)
    return base.replace(**changes)


def tiny_llama(**changes: Any) -> ModelConfig:
    base = tiny_dense(name="tiny-llama", qk_norm=False, tie_embeddings=True, num_heads=6,
                      num_kv_heads=2)
    return base.replace(**changes)


PRESETS = {
    "qwen3-8b": qwen3_8b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "smollm2-135m": smollm2_135m,
    "tiny-dense": tiny_dense,
    "tiny-moe": tiny_moe,
    "tiny-llama": tiny_llama,
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


_MISSING = object()


class _Keys:
    """Typed reads of an HF config dict; every missing or mistyped key is kept for one error."""

    def __init__(self, hf: dict[str, Any]):
        self.hf, self.problems = hf, []

    def get(self, key: str, default=_MISSING, kind: str = "positive integer"):
        value = self.hf.get(key, default)
        if value is _MISSING:
            self.problems.append(f"missing key {key!r}")
        elif value is None and default is None:
            return None
        elif not _KINDS[kind](value):
            self.problems.append(f"key {key!r} must be a {kind}, got {value!r}")
        else:
            return value
        return 1 if kind != "boolean" else False  # a stand-in, so the rest is still checked


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_KINDS = {
    "positive integer": lambda x: _is_int(x) and x > 0,
    "non-negative integer": lambda x: _is_int(x) and x >= 0,
    "positive number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0,
    "boolean": lambda x: isinstance(x, bool),
    "token id or list of token ids": lambda x: _is_int(x) or (
        isinstance(x, list) and all(_is_int(i) for i in x)),
    "list of layer indices": lambda x: isinstance(x, list) and all(_is_int(i) for i in x),
    "list of class names": lambda x: isinstance(x, list) and all(isinstance(a, str) for a in x),
    "object": lambda x: isinstance(x, dict),
}


def from_hf_config(hf: dict[str, Any], name: str = "hf-model", where: str | None = None
                   ) -> ModelConfig:
    """Builds a ModelConfig from a transformers `config.json` dict. One ConfigError (prefixed
    with `where`, the file) names every missing or mistyped key, or what is unsupported."""
    prefix = f"{where}: " if where else ""
    if not isinstance(hf, dict):
        raise ConfigError(f"{prefix}expected a JSON object of config keys, got "
                          f"{type(hf).__name__}")
    keys = _Keys(hf)
    archs = keys.get("architectures", [], "list of class names")
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known:
        raise ConfigError(
            f"{prefix}unsupported architecture {archs or hf.get('model_type')!r} (key "
            f"'architectures'); supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    kind = SUPPORTED_ARCHITECTURES[known[0]]
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{prefix}attention or MLP biases are not supported (keys "
                          "'attention_bias', 'mlp_bias')")
    rope = keys.get("rope_scaling", None, "object")
    if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise ConfigError(f"{prefix}unsupported rope_scaling {rope!r}")
    params = keys.get("rope_parameters", None, "object") or {}
    rope_theta = hf["rope_theta"] if "rope_theta" in hf else params.get("rope_theta", 10_000.0)
    if not _KINDS["positive number"](rope_theta):
        keys.problems.append(f"key 'rope_theta' must be a positive number, got {rope_theta!r}")
        rope_theta = 1.0
    eos = keys.get("eos_token_id", None, "token id or list of token ids")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    width = keys.get("hidden_size")
    num_heads = keys.get("num_attention_heads")
    cfg = dict(
        name=name,
        vocab_size=keys.get("vocab_size", kind="non-negative integer"),
        hidden_size=width,
        num_layers=keys.get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=keys.get("num_key_value_heads", num_heads),
        head_dim=keys.get("head_dim", None) or width // num_heads,
        intermediate_size=keys.get("intermediate_size", 0, "non-negative integer"),
        rope_theta=float(rope_theta),
        rms_norm_eps=keys.get("rms_norm_eps", 1e-6, "positive number"),
        qk_norm=kind != "llama",
        tie_embeddings=keys.get("tie_word_embeddings", False, "boolean"),
        max_position_embeddings=keys.get("max_position_embeddings", 4096),
        eos_token_ids=eos_ids,
    )
    if kind == "qwen3_moe":
        step = keys.get("decoder_sparse_step", 1)
        dense_only = set(keys.get("mlp_only_layers", None, "list of layer indices") or [])
        moe_layers = tuple(
            i for i in range(cfg["num_layers"]) if i not in dense_only and (i + 1) % step == 0
        )
        cfg.update(
            num_experts=keys.get("num_experts"),
            experts_per_token=keys.get("num_experts_per_tok"),
            moe_intermediate_size=keys.get("moe_intermediate_size"),
            norm_topk_prob=keys.get("norm_topk_prob", True, "boolean"),
            moe_layers=None if len(moe_layers) == cfg["num_layers"] else moe_layers,
        )
    if keys.problems:
        raise ConfigError(prefix + "; ".join(keys.problems))
    try:
        return ModelConfig(**cfg)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from None


def load_hf_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """An HF checkpoint's config.json (or the directory holding it) -> ModelConfig; every
    problem is one ConfigError naming the file (and the key)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no config.json at {file}")
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON: {e}") from None
    return from_hf_config(hf, name=name or file.parent.name, where=str(file))
