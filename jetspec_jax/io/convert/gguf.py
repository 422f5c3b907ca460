"""GGUF files (llama.cpp) of the `llama` and `qwen3` architectures -> (config, params).

Read with `gguf_file.read_gguf` (memory-mapped) and dequantised to float32 with
`gguf.quants.dequantize`. Layout facts this relies on:
- numpy shapes are GGUF's `ne` reversed, so a matrix reads as HF's `[out, in]`;
- llama.cpp's converter permutes the rows of the llama arch's q/k projections so that each
  head's rotary pairs are interleaved (x0, x_{H/2}, x1, ...) for its GPT-J-style rope; we use the
  HF half-split layout, so those rows are put back. Qwen3 uses NeoX rope in llama.cpp and is
  stored unpermuted.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np

from jetspec_jax.io.convert.common import ConversionError, Rule, convert_tensors
from jetspec_jax.io.convert.gguf_file import GGUFFile, read_gguf
from jetspec_jax.model.config import ModelConfig

ARCHITECTURES = ("llama", "qwen3")
Q = gguf.GGMLQuantizationType
# Types whose dequantisation is checked against an independent implementation in the tests.
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0)


def _unpermute(num_heads):
    """Undoes llama.cpp's `permute`: rows [heads, H/2, 2] -> HF's [heads, 2, H/2]."""

    def fix(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        n = num_heads(cfg)
        return w.reshape(n, cfg.head_dim // 2, 2, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)

    return fix


def rules(arch: str) -> list[Rule]:
    fix_q = _unpermute(lambda c: c.num_heads) if arch == "llama" else None
    fix_k = _unpermute(lambda c: c.num_kv_heads) if arch == "llama" else None
    b = r"blk\.(\d+)\."
    return [
        Rule(r"token_embd\.weight", "embed"),
        Rule(r"output_norm\.weight", "final_norm"),
        Rule(r"output\.weight", "lm_head", "linear"),
        Rule(b + r"attn_norm\.weight", "layers/{0}/attn_norm"),
        Rule(b + r"attn_q\.weight", "layers/{0}/q", "linear", fix=fix_q),
        Rule(b + r"attn_k\.weight", "layers/{0}/k", "linear", fix=fix_k),
        Rule(b + r"attn_v\.weight", "layers/{0}/v", "linear"),
        Rule(b + r"attn_output\.weight", "layers/{0}/o", "linear"),
        Rule(b + r"attn_q_norm\.weight", "layers/{0}/q_norm"),
        Rule(b + r"attn_k_norm\.weight", "layers/{0}/k_norm"),
        Rule(b + r"ffn_norm\.weight", "layers/{0}/mlp_norm"),
        Rule(b + r"ffn_gate\.weight", "layers/{0}/gate", "linear"),
        Rule(b + r"ffn_up\.weight", "layers/{0}/up", "linear"),
        Rule(b + r"ffn_down\.weight", "layers/{0}/down", "linear"),
    ]


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensors, with a clear error for a missing, truncated or corrupt
    file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    try:
        reader = read_gguf(path)
    except Exception as e:  # a cut header, a bad value type, bytes that are not UTF-8
        raise ConversionError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from e
    short = [t.name for t in reader.tensors if t.data.nbytes != t.n_bytes]
    if short:
        raise ConversionError(f"{path} is truncated: tensors {short[:5]} are cut off")
    return reader


def metadata(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_config(reader: GGUFFile, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata; every missing or unsupported key reported together."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConversionError(f"unsupported GGUF architecture {arch!r}; supported: {ARCHITECTURES}")
    problems: list[str] = []

    def get(key, default=None, kind=int):
        value = metadata(reader, f"{arch}.{key}", default)
        if value is None:
            problems.append(f"missing metadata {arch}.{key}")
        elif not isinstance(value, (int, float)):
            problems.append(f"{arch}.{key} = {value!r} is not a single {kind.__name__}")
        else:
            return float(f"{value:.7g}") if kind is float else int(value)  # float32 -> 1e-05
        return kind(1)

    width, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", width // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        problems.append("partial rotary embeddings (rope.dimension_count != head dim)")
    if metadata(reader, f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or (
        metadata(reader, f"{arch}.rope.scaling.factor", 1.0) != 1.0
    ):
        problems.append("rope scaling is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # its count, if vocab_size is absent
    eos = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    cfg = dict(
        name=name,
        vocab_size=get("vocab_size", len(tokens) if tokens else None),
        hidden_size=width,
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        intermediate_size=get("feed_forward_length"),
        rope_theta=get("rope.freq_base", 10_000.0, float),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", kind=float),
        qk_norm=arch == "qwen3",
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        max_position_embeddings=get("context_length", 4096),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )
    if problems:
        raise ConversionError("cannot build a config from the GGUF metadata:\n  "
                              + "\n  ".join(problems))
    return ModelConfig(**cfg)


def load_gguf(path: str | Path, *, dtype=jnp.bfloat16, name: str | None = None,
              progress: bool = True) -> tuple[ModelConfig, dict]:
    """Converts the GGUF file at `path` -> (config, params), dequantised and cast to dtype."""
    path = Path(path)
    reader = open_gguf(path)
    cfg = gguf_config(reader, name or path.stem)
    tensors = {t.name: t for t in reader.tensors}
    unsupported: dict[str, list[str]] = {}  # type name -> tensors
    for n, t in tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            unsupported.setdefault(t.tensor_type.name, []).append(n)
    problems = [f"{len(names)} tensors of type {q} (e.g. {names[0]}); supported types: "
                f"{[s.name for s in SUPPORTED_TYPES]}" for q, names in unsupported.items()]

    def read(key: str) -> np.ndarray:
        t = tensors[key]
        shape = tuple(reversed(t.shape))  # numpy order is GGUF's ne reversed
        rows = t.data.reshape(*shape[:-1], -1)  # bytes per row of ne0 values
        return gguf.quants.dequantize(rows, t.tensor_type).reshape(shape)

    skipped = [n for names in unsupported.values() for n in names]
    params = convert_tensors(cfg, rules(metadata(reader, "general.architecture")), tensors, read,
                             dtype=dtype, what=f"GGUF file {path}", ignore=skipped,
                             problems=problems, progress=progress)
    return cfg, params
