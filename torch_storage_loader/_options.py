"""``check_option``: the one check of the public constructors' option types and ranges.

A wrong type fails at the constructor with a ``TypeError`` naming the option, the type expected
and the type given (``batch_size='16' must be an int >= 1 (or None), got str``), not later with
whatever comparison or arithmetic first trips on it. ``bool`` is an ``int`` to Python but never a
count or a size here: ``worker_num=True`` is refused. A value of the right type out of range is a
``ValueError`` saying the range (and what None means, where None is allowed).

``take`` makes a public class's options record (a frozen dataclass that checks its fields as it is
made: their one list and check) from the ``locals()`` of a constructor whose keyword parameters
mirror its fields; the signature stays explicit for the docs and IDEs, tests/test_options.py asserts
that the two agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["check_option", "take"]

T = TypeVar("T", bound="DataclassInstance")

_KIND = {int: "an int", float: "a number", bool: "a bool", str: "a string"}


def check_option(
    name: str,
    value: object,
    kind: type,
    *,
    least: float | None = None,
    above: float | None = None,
    none: str | None = None,
) -> None:
    """Raise unless ``value`` suits the option ``name``.

    Args:
        name: The option's name, as the user spells it.
        value: What the user passed.
        kind: ``int``, ``float`` (an int or a float), ``bool`` or ``str``.
        least: The smallest value allowed (numbers).
        above: The value must be greater than this (numbers).
        none: Where None is allowed, what it means ("for single samples"); None: not allowed.

    Raises:
        TypeError: ``value`` is not of ``kind`` (a bool where a number is meant included).
        ValueError: ``value`` is below ``least`` or not above ``above``.
    """
    if value is None and none is not None:
        return
    bound = f" >= {least}" if least is not None else f" > {above}" if above is not None else ""
    numbers = (int, float) if kind is float else kind
    if not isinstance(value, numbers) or (kind is not bool and isinstance(value, bool)):
        either = " (or None)" if none is not None else ""
        raise TypeError(f"{name}={value!r} must be {_KIND[kind]}{bound}{either}, got {type(value).__name__}")
    if (least is not None and not value >= least) or (above is not None and not value > above):  # type: ignore[operator]
        raise ValueError(f"{name}={value!r} must be{bound}" + (f", or None {none}" if none is not None else ""))


def take(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls`` made (so checked) from the values of its fields' names in ``values``.

    Args:
        cls: The options dataclass.
        values: The ``locals()`` of the constructor whose parameters mirror ``cls``'s fields.

    Returns:
        The options; ``cls`` raises ``TypeError`` or ``ValueError`` naming the first one that is wrong.
    """
    return cls(**{field.name: values[field.name] for field in dataclasses.fields(cls)})
