"""The config's models (`exporter.core.typed`): what a value written in YAML or filled from `${VAR}`
may be, every problem told at once with its location, tagged unions, and frozen, comparable,
copyable results that never show a secret."""

from __future__ import annotations

import pickle
import sys
import threading
from decimal import Decimal
from typing import Annotated, Any, Literal

import pytest

from exporter.core.typed import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Model,
    SecretStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)


class Inner(Model):
    count: Annotated[int, Field(ge=1, le=5)] = 1
    share: Annotated[float, Field(gt=0, lt=1)] = 0.5
    on: bool = False
    price: Annotated[Decimal, Field(ge=0)] = Decimal(0)
    name: Annotated[str, Field(min_length=1, pattern=r"^[a-z]+$")] = "a"
    kind: Literal["x", "y", "z"] = "x"
    few: Annotated[tuple[Literal["p", "q"], ...], Field(max_length=1)] = ()
    labels: dict[str, str] = Field(default_factory=dict)


class Outer(Model):
    inner: Inner
    items: tuple[Inner, ...] = ()
    secret: SecretStr | None = None
    for_: float = Field(0.0, alias="for")


def problems(model: type[Model], data: Any) -> list[tuple[str, tuple[int | str, ...]]]:
    with pytest.raises(ValidationError) as raised:
        model.model_validate(data)
    return [(error["type"], error["loc"]) for error in raised.value.errors()]


@pytest.mark.parametrize(
    ("key", "written", "read"),
    [
        ("count", "3", 3),
        ("count", " 3 ", 3),
        ("count", "3.0", 3),
        ("count", 3.0, 3),
        ("count", True, 1),
        ("share", "0.25", 0.25),
        ("share", 0, None),
        ("on", "yes", True),
        ("on", "Off", False),
        ("on", 1, True),
        ("on", "maybe", None),
        ("price", "2.50", Decimal("2.50")),
        ("price", 1.5, Decimal("1.5")),
        ("price", True, None),
        ("price", "NaN", None),
        ("count", "1e3", None),
        ("count", 2.5, None),
        ("count", None, None),
        ("name", 5, None),
        ("kind", "w", None),
        ("few", ["p"], ("p",)),
        ("few", "p", None),
        ("few", {"q"}, ("q",)),
        ("count", "٣", None),  # (digits of other scripts, which int() reads)
        ("share", "٠٫٥", None),
        ("count", "3.", None),
        ("count", "9" * 5000, None),  # (past the digits int() takes)
        ("share", 10**400, None),  # (past any float)
        ("count", 1e20, None),
        ("count", float("nan"), None),
        ("name", b"abc", "abc"),  # (YAML's !!binary)
        ("count", b"2", 2),
    ],
)
def test_a_value_is_read_as_its_type_takes_it_written(key: str, written: object, read: object) -> None:
    """Text a `${VAR}` filled is read as the number or switch it spells; what no reading fits is refused."""
    if read is None:
        assert [loc for _, loc in problems(Inner, {key: written})] == [(key,)]
    else:
        assert getattr(Inner.model_validate({key: written}), key) == read


def test_every_problem_is_told_at_once_with_its_location() -> None:
    data = {
        "inner": {"count": 9, "name": "", "kind": "w", "labels": {"a": 1}},
        "items": [{}, {"few": ["p", "q"]}, {"few": ["r"], "nope": 1}, "text"],
        "extra": True,
        "for": "soon",
    }
    assert problems(Outer, data) == [
        ("less_than_equal", ("inner", "count")),
        ("string_too_short", ("inner", "name")),
        ("literal_error", ("inner", "kind")),
        ("string_type", ("inner", "labels", "a")),
        ("too_long", ("items", 1, "few")),
        ("literal_error", ("items", 2, "few", 0)),
        ("extra_forbidden", ("items", 2, "nope")),
        ("model_type", ("items", 3)),
        ("float_parsing", ("for",)),
        ("extra_forbidden", ("extra",)),
    ]
    assert problems(Outer, {}) == [("missing", ("inner",))]
    assert problems(Outer, []) == [("model_type", ())]


def test_a_list_held_past_its_length_is_told_too_long_alone() -> None:
    """Its items are read in order, and the first one held past `max_length` ends the reading: the
    items before it that failed are not told (a user who mends them learns next that it is too long)."""
    assert problems(Inner, {"few": ["p", "r", "q"]}) == [("too_long", ("few",))]
    assert problems(Inner, {"few": ["p", "q", "r"]}) == [("too_long", ("few",))]
    assert problems(Inner, {"few": ["r", "p"]}) == [("literal_error", ("few", 0))]
    assert problems(Inner, {"few": ["r", "s"]}) == [("literal_error", ("few", 0)), ("literal_error", ("few", 1))]


def test_what_is_refused_is_told_as_pydantic_tells_it() -> None:
    """The error types `check`'s messages are chosen by, for the readings pydantic refuses apart."""
    assert problems(Inner, {"count": "9" * 5000})[0][0] == "int_parsing_size"
    assert problems(Inner, {"count": 1e20})[0][0] == "int_parsing_size"
    assert problems(Inner, {"count": float("inf")})[0][0] == "finite_number"
    assert problems(Inner, {"share": 10**400})[0][0] == "float_type"
    assert problems(Inner, {"share": float("nan")}) == [("less_than", ("share",))]  # (the upper bound first)
    assert problems(Inner, {1: "x"}) == [("invalid_key", (1,))]
    assert problems(Inner, {True: "y"}) == [("invalid_key", (1,))]  # (as pydantic tells it)
    assert problems(Inner, {"name": b"\xff"})[0][0] == "string_unicode"


def test_messages_say_the_bound_and_the_choices() -> None:
    with pytest.raises(ValidationError) as raised:
        Inner.model_validate({"count": 0, "kind": "w", "few": ["p", "q"], "share": 1})
    told = {error["loc"][0]: (error["msg"], error["ctx"]) for error in raised.value.errors()}
    assert told["count"] == ("Input should be greater than or equal to 1", {"ge": 1})
    assert told["kind"] == ("Input should be 'x', 'y' or 'z'", {"expected": "'x', 'y' or 'z'"})
    assert told["few"][0] == "Tuple should have at most 1 item after validation, not 2"
    assert told["share"] == ("Input should be less than 1", {"lt": 1})


def _even(value: int) -> int:
    if value % 2:
        raise ValueError("must be even")
    return value


class Checked(Model):
    low: Annotated[int, BeforeValidator(lambda v: v.strip() if isinstance(v, str) else v), AfterValidator(_even)]
    high: int

    @field_validator("high")
    @classmethod
    def _not_huge(cls, value: int) -> int:
        if value > 100:
            raise ValueError("too high")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> Checked:
        if self.low > self.high:
            raise ValueError("low is above high")
        return self


class Stacked(Model):
    name: Annotated[str, BeforeValidator(lambda v: f"{v}1"), BeforeValidator(lambda v: f"{v}2")]


def test_before_validators_take_the_value_the_last_written_first() -> None:
    assert Stacked(name="x").name == "x21"


def test_validators_run_in_their_order_and_the_models_only_once_its_fields_hold() -> None:
    assert Checked.model_validate({"low": " 2 ", "high": 4}).low == 2
    with pytest.raises(ValidationError) as raised:
        Checked.model_validate({"low": 3, "high": 101})
    assert [(e["loc"], str(e["ctx"]["error"])) for e in raised.value.errors()] == [
        (("low",), "must be even"),
        (("high",), "too high"),
    ]
    with pytest.raises(ValidationError) as raised:
        Checked(low=4, high=2)
    assert [(e["type"], e["loc"], e["msg"]) for e in raised.value.errors()] == [
        ("value_error", (), "Value error, low is above high")
    ]


class Cat(Model):
    type: Literal["cat"]
    lives: int = 9


class Dog(Model):
    type: Literal["dog"]
    good: bool = True


class Pets(Model):
    pets: Annotated[tuple[Annotated[Cat | Dog, Field(discriminator="type")], ...], Field(min_length=2)] = ()
    rule: Annotated[
        Annotated[Cat, Tag("feline")] | Annotated[Dog, Tag("canine")],
        Discriminator(lambda v: "feline" if isinstance(v, dict) and "lives" in v else "canine"),
    ] = Dog(type="dog")


class Tagless(float):
    """A number that is an object with attributes (the config's YAML reads floats as such)."""


def test_a_tagged_union_reads_each_item_as_its_tag_says_and_names_the_tag_where_it_fails() -> None:
    pets = Pets.model_validate({"pets": [{"type": "cat"}, {"type": "dog", "good": "no"}]}).pets
    assert pets == (Cat(type="cat", lives=9), Dog(type="dog", good=False))
    assert Pets(pets=pets).pets == pets  # (items made already are taken as they are)
    assert problems(Pets, {"pets": [{"type": "dog", "lives": 3}, {"type": "cow"}, {}, "cat", Tagless()]}) == [
        ("extra_forbidden", ("pets", 0, "dog", "lives")),
        ("union_tag_invalid", ("pets", 1)),
        ("union_tag_not_found", ("pets", 2)),
        ("model_attributes_type", ("pets", 3)),
        ("union_tag_not_found", ("pets", 4)),  # (an object, as a YAML float is here: its tag not found)
        ("too_short", ("pets",)),
    ]
    # The length is judged on the items that hold: one of two holding is too short.
    assert problems(Pets, {"pets": [{"type": "cat"}, {"type": "cow"}]}) == [
        ("union_tag_invalid", ("pets", 1)),
        ("too_short", ("pets",)),
    ]
    assert problems(Pets, {"rule": {"type": "cat", "lives": "many"}}) == [("int_parsing", ("rule", "feline", "lives"))]
    with pytest.raises(ValidationError) as raised:
        Pets.model_validate({"pets": [{"type": "cow"}, {"type": "cat"}, {"type": "dog"}]})
    (error,) = raised.value.errors()
    assert error["ctx"] == {"discriminator": "'type'", "tag": "cow", "expected_tags": "'cat', 'dog'"}


def test_a_model_is_frozen_comparable_copyable_and_survives_pickling() -> None:
    outer = Outer.model_validate({"inner": {"count": 2}, "for": 5})
    with pytest.raises(ValidationError):
        outer.for_ = 1.0  # type: ignore[misc]
    assert outer == Outer(inner=Inner(count=2), **{"for": 5.0})
    assert outer != Outer(inner=Inner(count=3), **{"for": 5.0})
    moved = outer.model_copy(update={"for_": 6.0})
    assert (moved.for_, outer.for_, moved.inner) == (6.0, 5.0, outer.inner)
    assert pickle.loads(pickle.dumps(outer)) == outer  # noqa: S301 (what it has just written)
    assert hash(Cat(type="cat")) == hash(Cat(type="cat"))
    assert Outer.model_fields["for_"].alias == "for"
    assert outer.model_dump(mode="json", exclude={"items"}) == {
        "inner": {**Inner().model_dump(mode="json"), "count": 2},
        "secret": None,
        "for_": 5.0,
    }


def test_a_secret_is_kept_out_of_its_model_and_of_every_error() -> None:
    value = "sk-live-0123456789"
    outer = Outer.model_validate({"inner": {}, "secret": value})
    assert outer.secret is not None
    assert outer.secret.get_secret_value() == value
    assert value not in repr(outer)
    assert value not in str(outer.secret)
    assert value not in str(outer.model_dump(mode="json"))
    with pytest.raises(ValidationError) as raised:
        Outer.model_validate({"inner": {"name": value}, "secret": 5})
    assert value not in str(raised.value)
    assert [(e["type"], e["loc"]) for e in raised.value.errors()] == [
        ("string_pattern_mismatch", ("inner", "name")),
        ("string_type", ("secret",)),
    ]


def test_threads_using_a_model_first_at_once_each_get_it_whole() -> None:
    """A model resolves its fields at first use; threads racing to it (the switch interval made
    tiny, so that they interleave) each validate as one thread alone would, in every round."""

    def fresh() -> type[Model]:
        class Part(Model):
            n: int = 0
            parts: tuple[int, ...] = ()

            @field_validator("n")
            @classmethod
            def _even(cls, value: int) -> int:
                if value % 2:
                    raise ValueError("odd")
                return value

        return Part

    told: list[object] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(200):
            whole = fresh()
            start = threading.Barrier(8)

            def use(n: int, whole: type[Model] = whole, start: threading.Barrier = start) -> None:
                start.wait()
                try:
                    told.append(len(whole.model_validate({"n": 2 * n, "parts": [n]}).parts))
                except Exception as error:  # (any failure is what the test counts)
                    told.append(repr(error))

            threads = [threading.Thread(target=use, args=(n,)) for n in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert set(told) == {1}
    assert len(told) == 200 * 8
