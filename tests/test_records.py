"""schemas.records.quick_init: the faster __init__ builds what the dataclass's own builds; and a reply
entry decoded as the client sees it, in one record."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.redis.inbox import InboxEntry, JobKind
from broker.redis.layouts import ReplyEntry
from broker.redis.scripts import CommitCall
from schemas.codec import encode
from schemas.limits import Limits
from schemas.messages import Mode
from schemas.records import quick_init
from schemas.results import Latency, StepResult
from schemas.world_messages import Action, Observation, WorldStep


def _twins() -> tuple[type[Any], type[Any]]:
    """One layout twice: with the dataclass's __init__ and with quick_init's."""
    def make() -> type[Any]:
        @dataclass(frozen=True)
        class Layout:
            a: int
            b: str = "b"
            c: list[int] = field(default_factory=list)
            d: dict[str, int] = field(default_factory=dict, init=False)
            e: int = field(default=5, init=False)
            f: float = field(default=1.5, kw_only=True)
            g: tuple[int, ...] = field(default_factory=tuple, kw_only=True)
            seen: list[str] = field(default_factory=list, compare=False, repr=False)

            def __post_init__(self) -> None:
                self.seen.append(f"post:{self.a}")

        return Layout

    return make(), quick_init(make())


@pytest.mark.parametrize("args, kwargs", [
    ((1,), {}),
    ((1, "x", [2, 3]), {"f": 2.5, "g": (4,)}),
    ((), {"a": 7, "c": [], "f": 0.0}),
])
def test_builds_what_the_dataclass_builds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    plain, quick = _twins()
    want, got = plain(*args, **kwargs), quick(*args, **kwargs)
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
    assert got.seen == want.seen == [f"post:{want.a}"]  # __post_init__ ran once
    assert repr(got).replace(quick.__qualname__, "") == repr(want).replace(plain.__qualname__, "")


def test_default_factories_give_each_instance_its_own_value() -> None:
    _, quick = _twins()
    one, two = quick(1), quick(2)
    assert one.c == two.c == [] and one.c is not two.c
    assert one.d is not two.d


def test_the_instance_stays_frozen_hashable_and_replaceable() -> None:
    _, quick = _twins()
    obj = quick(1, g=(1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.a = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        del obj.b
    moved = dataclasses.replace(obj, a=3)
    assert (moved.a, moved.g, obj.a) == (3, (1, 2), 1)
    assert obj == quick(1, g=(1, 2)) and obj != moved
    assert hash(Latency(1.0, 2.0)) == hash(Latency(1.0, 2.0))


def test_argument_errors_are_the_dataclass_errors() -> None:
    _, quick = _twins()
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'a'"):
        quick()
    with pytest.raises(TypeError, match="unexpected keyword argument 'd'"):
        quick(1, d={})  # an init=False field is no parameter
    with pytest.raises(TypeError, match="positional argument"):
        quick(1, "b", [], [], 2.0)  # a kw_only field only by name


def test_the_signature_is_the_dataclass_signature() -> None:
    plain, quick = _twins()
    assert [(p.name, p.kind) for p in inspect.signature(quick).parameters.values()] == [
        (p.name, p.kind) for p in inspect.signature(plain).parameters.values()]


def test_refuses_what_it_cannot_build() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass(frozen=True)
    class WithInitVar:
        a: int
        scale: dataclasses.InitVar[int] = 1

    for cls in (Mutable, Slotted, WithInitVar, int):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)


def test_the_step_records_build_as_before() -> None:
    """The classes that carry it build field for field what their dataclass layout says, and only
    their fields."""
    samples: list[Any] = [
        StepResult("s", 3, True, 3, output={"x": 1}, latency=Latency(1.0, 2.0), worker_id="w"),
        WorldStep(Observation("p", state=(0.1,) * 8), Action((0.1,) * 7, (0.5,))),
        ReplyEntry("step", "j", 3, b"r"),
        CommitCall("s", "w", 1, 3, "1-0", b"r", 4, "j", "reply", 60_000, version=2),
        InboxEntry("1-0", JobKind.STEP, "j", "s", 3, True, 1, 0, Mode.WORLD_MODEL_ENV, "m", "reply", 0, 0, b""),
    ]
    for obj in samples:
        cls = type(obj)
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        assert cls(**values) == obj
        assert vars(obj) == values  # every field stored, nothing else


@pytest.mark.parametrize(("ok", "entry_committed", "committed"), [(True, 2, 4), (True, 7, 7), (False, 6, 6)])
def test_a_reply_entry_decodes_with_the_clients_committed_id_and_timing(
    ok: bool, entry_committed: int, committed: int
) -> None:
    """A success reports the later of its own committed id and the entry's (a later commit may have
    landed), a failure the entry's; commit_ms is what queue and engine time leave of the round trip,
    never negative."""
    sent = StepResult("s", 4, ok, 4 if ok else 5, output={"x": 1} if ok else None,
                      latency=Latency(queue_ms=1.5, engine_ms=2.0, commit_ms=9.0, total_ms=9.0), worker_id="w")
    entry = ReplyEntry("step", "j", entry_committed, encode(sent.to_wire()))
    plain = entry.step_result(Limits())
    assert plain == sent
    seen = entry.step_result(Limits(), total_ms=10.0)
    assert seen == dataclasses.replace(sent, committed_step_id=committed,
                                       latency=Latency(queue_ms=1.5, engine_ms=2.0, commit_ms=6.5, total_ms=10.0))
    assert entry.step_result(Limits(), total_ms=3.0).latency.commit_ms == 0.0
