"""Shared by the HF and GGUF converters: a table of `source key regex -> (our path, layout)`
applied to lazily read tensors, with every problem collected into one error.

A rule's layout says how a source tensor maps onto our leaf, whose shape comes from
`params.target_specs`: "copy" (same shape) or "linear" (an HF `[out, in]` matrix, transposed and
reshaped to our `[in..., out...]`). From that the expected source shape is known, so a wrong
shape is reported by its source name before anything is reshaped.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jetspec_jax.io.sources import package_file  # noqa: F401 (re-exported)
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.params import target_specs, unflatten


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message lists every problem found."""


Fix = Callable[[np.ndarray, ModelConfig], np.ndarray]
MOE_STACKED = ("gate", "up", "down")  # per-expert source tensors stacked into one leaf


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str  # full match over the source key
    path: str  # ours, "/"-separated; "{0}" is the layer index group
    layout: str = "copy"  # "copy" or "linear"
    fix: Fix | None = None  # applied to the source array first (e.g. llama.cpp's Q/K row order)
    expert_group: int | None = None  # regex group holding the expert index of a stacked leaf

    def match(self, key: str):
        return re.fullmatch(self.pattern, key)


def source_shape(leaf_shape: tuple[int, ...], layout: str, n_in: int) -> tuple[int, ...]:
    """The source shape that maps onto our leaf shape under layout."""
    if layout == "copy":
        return leaf_shape
    return (math.prod(leaf_shape[n_in:]), math.prod(leaf_shape[:n_in]))


def _flat_specs(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    specs = target_specs(cfg)
    flat = {k: s.shape for k, s in specs.items() if k != "layers"}
    for i, layer in enumerate(specs["layers"]):
        flat.update({f"layers/{i}/{k}": s.shape for k, s in layer.items()})
    return flat


def convert_tensors(
    cfg: ModelConfig,
    rules: list[Rule],
    keys: Iterable[str],
    read: Callable[[str], np.ndarray],
    *,
    dtype,
    what: str,
    ignore: Iterable[str] = (),
    problems: Iterable[str] = (),
    progress: bool = True,
):
    """Reads every key through `read`, maps it by `rules` and returns our params tree.

    Keys in `ignore` are skipped (and their leaves not reported missing); `problems` already
    found by the caller are reported with ours. Raises one ConversionError listing unmatched
    keys, wrong source shapes, incomplete expert stacks and whatever `check_params` finds.
    """
    tree = _Assembly(cfg, rules, jnp.dtype(dtype), list(problems))
    ignore = set(ignore)
    tree.accounted |= {r.path.format(*m.groups()) for k in ignore for r in rules
                       if (m := r.match(k))}
    for key in tqdm(sorted(set(keys) - ignore, key=_natural), desc="converting", unit="tensor",
                    disable=not progress):
        tree.add(key, read)
    return tree.finish(what)


class _Assembly:
    """Our leaves as they are converted, plus every problem seen so far."""

    def __init__(self, cfg: ModelConfig, rules: list[Rule], dtype, problems: list[str]):
        self.cfg, self.rules, self.dtype, self.problems = cfg, rules, dtype, problems
        self.leaf_shapes = _flat_specs(cfg)
        self.flat: dict[str, np.ndarray] = {}
        self.experts: dict[str, set[int]] = {}  # stacked leaf -> experts filled
        self.accounted: set[str] = set()  # leaves with a source tensor that was reported

    def add(self, key: str, read: Callable[[str], np.ndarray]) -> None:
        rule, m = next(((r, m) for r in self.rules if (m := r.match(key))), (None, None))
        if rule is None:
            return self.problems.append(f"unexpected tensor {key}")
        path = rule.path.format(*m.groups())
        if path not in self.leaf_shapes:
            return self.problems.append(f"unexpected tensor {key} (no {path} in the config)")
        shape = self.leaf_shapes[path]
        expert = None if rule.expert_group is None else int(m.group(rule.expert_group))
        if expert is not None:
            if expert >= shape[0]:
                return self.problems.append(
                    f"unexpected tensor {key}: expert {expert} >= {shape[0]}")
            shape = shape[1:]
        want = source_shape(shape, rule.layout, 2 if path.endswith("/o") else 1)  # o: [N, H, D]
        array = read(key)
        if tuple(array.shape) != want:
            self.accounted.add(path)
            return self.problems.append(
                f"shape mismatch {key}: expected {want}, got {tuple(array.shape)}")
        if rule.fix is not None:
            array = rule.fix(array, self.cfg)
        if rule.layout == "linear":
            array = array.T.reshape(shape)
        array = np.asarray(array, dtype=self.dtype)
        if expert is None:
            self.flat[path] = array
            return
        if path not in self.flat:
            self.flat[path] = np.zeros(self.leaf_shapes[path], self.dtype)
            self.experts[path] = set()
        self.flat[path][expert] = array
        self.experts[path].add(expert)

    def finish(self, what: str):
        for path, seen in self.experts.items():
            if missing := sorted(set(range(self.leaf_shapes[path][0])) - seen):
                self.problems.append(f"missing tensor {path}: no weights for experts {missing}")
        params = None
        try:
            params = unflatten(self.flat, target_specs(self.cfg), what, absent=self.accounted)
        except ValueError as e:
            for line in (line.strip() for line in str(e).splitlines()[1:]):
                path = line.removeprefix("missing tensor ")
                if path == line:
                    self.problems.append(line)
                else:
                    source = _source_name(self.rules, path, self.cfg)
                    self.problems.append(f"{line} ({source})" if source else line)
        if self.problems:
            raise ConversionError(f"cannot convert {what}:\n  "
                                  + "\n  ".join(dict.fromkeys(self.problems)))
        return params


def _source_name(rules: list[Rule], path: str, cfg: ModelConfig) -> str | None:
    """The source key a rule would read for our path (experts as "*"), for error messages."""
    parts = path.split("/")
    layer = parts[1] if parts[0] == "layers" else None
    stacked = layer is not None and cfg.layer_is_moe(int(layer)) and parts[2] in MOE_STACKED
    for rule in rules:
        if (rule.expert_group is not None) != stacked or rule.path.format(layer) != path:
            continue
        name = rule.pattern.replace(r"(\d+)", layer or "", 1).replace(r"(\d+)", "*")
        return name.replace("\\", "")
    return None


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]

