"""A faster ``__init__`` for the frozen dataclasses built once or more per step.

A frozen dataclass's generated ``__init__`` sets each field with a call of
``object.__setattr__`` (its own ``__setattr__`` refuses): 627 ns for eight fields on this project's
machines, where a plain dataclass takes 131. A tiny world step builds about 110 such fields over
both sides (the job, the commit call, the result, its latency, the parsed input). :func:`quick_init`
gives a frozen dataclass an ``__init__`` that writes the fields into the instance's ``__dict__``
instead: the same signature, defaults, default factories and ``__post_init__``, so the class
behaves as before (``bench.hot_path`` measures the difference).

The instance stays frozen: assigning or deleting a field still raises ``FrozenInstanceError``,
and ``eq``, ``hash``, ``repr``, ``dataclasses.replace`` and ``asdict`` are the dataclass's own.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")

_FROM_FACTORY = object()  # a parameter left out whose default is a factory's


def _field_code(f: dataclasses.Field[Any], names: dict[str, Any]) -> tuple[str | None, str]:
    """The field's ``__init__`` parameter (None for an ``init=False`` field) and the line that
    stores it; its default or default factory goes into ``names`` for the code to find."""
    param: str | None = f.name
    value = f.name
    if f.default is not dataclasses.MISSING:
        names[f"_default_{f.name}"] = f.default
        param = f"{f.name}=_default_{f.name}"
        value = f.name if f.init else f"_default_{f.name}"
    elif f.default_factory is not dataclasses.MISSING:
        names[f"_factory_{f.name}"] = f.default_factory
        param = f"{f.name}=_FROM_FACTORY"
        value = f"_factory_{f.name}() if {f.name} is _FROM_FACTORY else {f.name}" if f.init else f"_factory_{f.name}()"
    return (param if f.init else None), f"_d[{f.name!r}] = {value}"


def quick_init(cls: type[T]) -> type[T]:
    """Replace the generated ``__init__`` of ``cls`` (a frozen dataclass without slots or InitVar
    parameters) with one that stores its fields directly. Raises TypeError for any other class,
    and if the new signature would differ from the dataclass's in its parameters' names or kinds."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init:
        raise TypeError(f"quick_init takes a frozen dataclass with a generated __init__, not {cls.__name__}")
    if "__slots__" in cls.__dict__:
        raise TypeError(f"quick_init: {cls.__name__} has slots and no instance __dict__ to write")
    names: dict[str, Any] = {"_FROM_FACTORY": _FROM_FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    body = ["_d = self.__dict__"]
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        param, line = _field_code(f, names)
        if param is not None:
            (keyword if f.kw_only else positional).append(param)
        body.append(line)
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    # Code built from the class's own field names only, as dataclasses builds its __init__.
    exec(f"def __init__({signature}):\n" + "".join(f"    {line}\n" for line in body), names)
    init = names["__init__"]
    before = inspect.signature(cls.__init__)
    if [(p.name, p.kind) for p in inspect.signature(init).parameters.values()] != [
            (p.name, p.kind) for p in before.parameters.values()]:
        raise TypeError(f"quick_init: {cls.__name__}'s __init__ takes parameters this cannot build ({before})")
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
