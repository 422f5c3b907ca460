"""The one resolver of kernel names, as tokamax's ops do it: a choice is an implementation's
name or an ordered list of names; the first implementation that serves the call runs. One
that cannot serve it (a shape, a dtype, a device it was not written for) raises
`NotImplementedError` and the next in the list is tried; when none serves, one
`NotImplementedError` gives every implementation's reason.

Each op's `api.py` holds its table of implementations and its default list; the model's
`jetspec_jax.model.kernels.choose` turns the names users type into these lists."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def names(choice: str | Sequence[str]) -> tuple[str, ...]:
    """A name or a list of names -> the tuple of names (hashable: static under jit)."""
    return (choice,) if isinstance(choice, str) else tuple(choice)


def check(op: str, choice: str | Sequence[str], known: Sequence[str]) -> tuple[str, ...]:
    """The choice as a tuple, or one ValueError naming the unknown names and the choices."""
    chosen = names(choice)
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise ValueError(f"unknown {op} implementation {', '.join(map(repr, unknown)) or '()'}; "
                         f"choose from {', '.join(known)} (or an ordered list of them)")
    return chosen


def run(op: str, choice: str | Sequence[str], impls: Mapping[str, Callable], *args, **kwargs):
    """impls[name](*args, **kwargs) for the first name of choice whose implementation serves
    the call (does not raise NotImplementedError)."""
    errors = []
    for name in check(op, choice, tuple(impls)):
        try:
            return impls[name](*args, **kwargs)
        except NotImplementedError as e:
            errors.append(f"{name}: {e}")
    raise NotImplementedError(f"no {op} implementation serves this call: " + "; ".join(errors))
