"""Frozen models checked against their type hints: what the config is made of.

A model is a class of annotated fields (`name: Annotated[str, Field(min_length=1)] = "x"`); building
it from a mapping checks every field, converts what a YAML or `${VAR}` value may be written as (a
number as text, `yes` for true) and collects every problem with its location before it raises
`ValidationError`. The error types, locations and `ctx` follow pydantic's, whose API this keeps
(`model_validate`, `model_fields`, `model_copy`, `field_validator`, `model_validator`, `SecretStr`),
for a small part of its cost: the CLI's `check` and `rules` start within three times a bare
interpreter, which importing pydantic and building the config's schema alone could not.

Types: `str`, `int`, `float`, `bool`, `Decimal`, `SecretStr`, `Literal`, `tuple[X, ...]`,
`dict[K, V]`, unions (`X | None`; models told apart by a `type` key or a `Discriminator`), models,
and `Annotated` with `BeforeValidator`, `AfterValidator`, `Field` constraints and `Tag`.
"""

from __future__ import annotations

import math
import operator
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal, InvalidOperation
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Self, Union, get_args, get_origin

Loc = tuple[int | str, ...]

_BAD: Any = object()
"""What a check returns for a value it refused (its errors are told in the list it was given)."""
_UNSET: Any = object()


class ValidationError(ValueError):
    """Every problem found in a value, each a mapping of `type`, `loc`, `msg` and `ctx`; the values
    themselves are never in it (a secret may be one)."""

    def __init__(self, title: str, errors: list[dict[str, Any]]) -> None:
        lines = [f"{len(errors)} validation error{'s' if len(errors) != 1 else ''} for {title}"]
        for error in errors:
            lines += [".".join(map(str, error["loc"])) or "(top level)", f"  {error['msg']} [type={error['type']}]"]
        super().__init__("\n".join(lines))
        self._errors = errors

    def errors(self) -> list[dict[str, Any]]:
        return [dict(error) for error in self._errors]


def _error(errors: list[dict[str, Any]], loc: Loc, kind: str, msg: str, **ctx: Any) -> Any:
    errors.append({"type": kind, "loc": loc, "msg": msg, "ctx": ctx})
    return _BAD


class SecretStr:
    """Text kept out of `repr` and `str` (`**********`): read with `get_secret_value`."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def get_secret_value(self) -> str:
        return self._secret

    def __str__(self) -> str:
        return "**********" if self._secret else ""

    def __repr__(self) -> str:
        return f"SecretStr('{self}')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretStr) and other._secret == self._secret

    def __hash__(self) -> int:
        return hash(self._secret)

    def __len__(self) -> int:
        return len(self._secret)


class BeforeValidator:
    """Runs on the value as given, before its type is checked; a ValueError is the value's error."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func


class AfterValidator:
    """Runs on the value once its type and constraints are checked; a ValueError is its error."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func


class Tag:
    """The name of a union's member that a `Discriminator` picks (and an error's location holds)."""

    __slots__ = ("tag",)

    def __init__(self, tag: str) -> None:
        self.tag = tag


class Discriminator:
    """Picks a union's member by its `Tag`: `func` gives the tag of a value."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Any], str | None]) -> None:
        self.func = func


class FieldInfo:
    """A field's default, alias and constraints; in `Annotated`, its constraints alone."""

    __slots__ = (
        "alias",
        "annotation",
        "default",
        "default_factory",
        "discriminator",
        "ge",
        "gt",
        "le",
        "lt",
        "max_length",
        "metadata",
        "min_length",
        "pattern",
    )

    def __init__(
        self,
        default: Any = _UNSET,
        *,
        alias: str | None = None,
        default_factory: Callable[[], Any] | None = None,
        discriminator: str | None = None,
        ge: Any = None,
        gt: Any = None,
        le: Any = None,
        lt: Any = None,
        min_length: int | None = None,
        max_length: int | None = None,
        pattern: str | None = None,
    ) -> None:
        self.default, self.alias, self.default_factory = default, alias, default_factory
        self.discriminator = discriminator
        self.ge, self.gt, self.le, self.lt = ge, gt, le, lt
        self.min_length, self.max_length, self.pattern = min_length, max_length, pattern
        self.annotation: Any = Any
        self.metadata: tuple[Any, ...] = ()

    def is_required(self) -> bool:
        return self.default is _UNSET and self.default_factory is None

    def get_default(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default

    def constrained(self, value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
        if isinstance(value, str):
            if self.min_length is not None and len(value) < self.min_length:
                return _error(
                    errors,
                    loc,
                    "string_too_short",
                    f"String should have at least {self.min_length} character{_s(self.min_length)}",
                    min_length=self.min_length,
                )
            if self.pattern is not None and not re.search(self.pattern, value):
                return _error(
                    errors,
                    loc,
                    "string_pattern_mismatch",
                    f"String should match pattern '{self.pattern}'",
                    pattern=self.pattern,
                )
        elif isinstance(value, tuple):
            lengths = (
                ("min_length", self.min_length, "too_short", "at least", operator.ge),
                ("max_length", self.max_length, "too_long", "at most", operator.le),
            )
            for name, bound, kind, words, holds in lengths:
                if bound is not None and not holds(len(value), bound):
                    told = f"Tuple should have {words} {bound} item{_s(bound)} after validation, not {len(value)}"
                    return _error(
                        errors, loc, kind, told, field_type="Tuple", **{name: bound}, actual_length=len(value)
                    )
        else:
            bounds = (  # (the upper bounds first, as pydantic: a NaN fails the first)
                ("le", self.le, "less_than_equal", "less than or equal to", operator.le),
                ("lt", self.lt, "less_than", "less than", operator.lt),
                ("ge", self.ge, "greater_than_equal", "greater than or equal to", operator.ge),
                ("gt", self.gt, "greater_than", "greater than", operator.gt),
            )
            for name, bound, kind, words, holds in bounds:
                if bound is not None and not holds(value, bound):
                    return _error(errors, loc, kind, f"Input should be {words} {bound}", **{name: bound})
        return value


def Field(default: Any = _UNSET, **given: Any) -> Any:  # noqa: N802 (pydantic's name, which readers know)
    """A field's default and alias (as its value in the class), or constraints (in `Annotated`): a
    `FieldInfo` of `given` (an argument it does not take is a TypeError), typed as any value so
    that `x: int = Field(...)` reads as the field's default."""
    return FieldInfo(default, **given)


def _s(count: int) -> str:
    return "" if count == 1 else "s"


class _FieldCheck:
    def __init__(self, names: tuple[str, ...], func: Any) -> None:
        self.names, self.func = names, func


class _ModelCheck:
    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func


def field_validator(*names: str) -> Callable[[Any], Any]:
    """A classmethod that checks (and may convert) the named fields once their types are checked."""
    return lambda func: _FieldCheck(names, func)


def model_validator(*, mode: Literal["after"]) -> Callable[[Any], Any]:
    """A method that checks the model once every field is valid; a ValueError is the model's error."""
    return _ModelCheck


class _ModelType(type):
    """Resolves a model's fields at their first use: the hints may name what the module defines after."""

    _field_checks: dict[str, list[Any]]
    _model_checks: list[Any]

    @property
    def model_fields(cls) -> dict[str, FieldInfo]:
        fields: dict[str, FieldInfo] | None = cls.__dict__.get("_fields")
        if fields is None:
            fields = _resolve(cls)
        return fields


class Model(metaclass=_ModelType):
    """A frozen model refusing keys it does not know. Build it with `Model(**data)` or
    `Model.model_validate(data)`; each raises `ValidationError` with every problem."""

    model_fields: ClassVar[dict[str, FieldInfo]]

    def __init__(self, **data: Any) -> None:
        errors: list[dict[str, Any]] = []
        made = _made(type(self), data, (), errors)
        if errors:
            raise ValidationError(type(self).__name__, errors)
        object.__setattr__(self, "__dict__", made.__dict__)

    @classmethod
    def model_validate(cls, data: Any) -> Self:
        errors: list[dict[str, Any]] = []
        made: Self = _check(cls, data, (), errors)
        if errors:
            raise ValidationError(cls.__name__, errors)
        return made

    def model_copy(self, *, update: Mapping[str, Any] | None = None) -> Self:
        """A copy with `update`'s fields (by name) replaced, unchecked."""
        copy: Self = _rebuilt(type(self), {**self.__dict__, **(update or {})})
        return copy

    def model_dump(
        self, *, mode: Literal["python", "json"] = "python", exclude: Iterable[str] = (), exclude_none: bool = False
    ) -> dict[str, Any]:
        """The fields by name, models in them as mappings; in `json` mode as JSON writes them
        (decimals as text, lists, a secret masked)."""
        left_out = set(exclude)
        return {
            name: _dumped(value, mode == "json", exclude_none)
            for name, value in self.__dict__.items()
            if name not in left_out and not (exclude_none and value is None)
        }

    def __setattr__(self, name: str, value: Any) -> None:
        raise ValidationError(
            type(self).__name__, [{"type": "frozen_instance", "loc": (name,), "msg": "Instance is frozen", "ctx": {}}]
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Model):
            return NotImplemented
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        return hash((type(self), *self.__dict__.values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _rebuilt(cls: Any, values: dict[str, Any]) -> Any:
    made = object.__new__(cls)
    object.__setattr__(made, "__dict__", values)
    return made


def _dumped(value: Any, json: bool, exclude_none: bool) -> Any:
    if isinstance(value, Model):
        return value.model_dump(mode="json" if json else "python", exclude_none=exclude_none)
    if isinstance(value, tuple):
        items = [_dumped(item, json, exclude_none) for item in value]
        return items if json else tuple(items)
    if isinstance(value, dict):
        return {key: _dumped(item, json, exclude_none) for key, item in value.items()}
    if json and isinstance(value, Decimal | SecretStr):
        return str(value)
    return value


def _resolve(cls: _ModelType) -> dict[str, FieldInfo]:
    hints = typing.get_type_hints(cls, include_extras=True)
    field_checks: dict[str, dict[str, Any]] = {}
    model_checks: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):  # (a check a subclass defines again under its name replaces it)
        # (a copy: another thread resolving the class at once adds its names to that namespace)
        for name, member in list(vars(klass).items()):
            if isinstance(member, _FieldCheck):
                for field in member.names:
                    field_checks.setdefault(field, {})[name] = member.func.__get__(None, cls)
            elif isinstance(member, _ModelCheck):
                model_checks[name] = member.func
    fields: dict[str, FieldInfo] = {}
    for name, hint in hints.items():
        if name.startswith("_") or get_origin(hint) is ClassVar:
            continue
        given = next((vars(klass)[name] for klass in cls.__mro__ if name in vars(klass)), _UNSET)
        info = FieldInfo()
        if isinstance(given, FieldInfo):
            for slot in FieldInfo.__slots__:
                setattr(info, slot, getattr(given, slot))
        else:
            info.default = given
        metadata: tuple[Any, ...] = ()
        if get_origin(hint) is Annotated:
            hint, *more = get_args(hint)
            metadata = tuple(more)
        info.annotation = hint
        info.metadata = (*metadata, info) if isinstance(given, FieldInfo) else metadata  # (its constraints)
        fields[name] = info
    type.__setattr__(cls, "_field_checks", {field: list(checks.values()) for field, checks in field_checks.items()})
    type.__setattr__(cls, "_model_checks", list(model_checks.values()))
    type.__setattr__(cls, "_fields", fields)
    return fields


def _fill(cls: _ModelType, data: Mapping[Any, Any], loc: Loc, errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields' values from `data` (checked, defaults for those it lacks), its errors in `errors`."""
    fields = cls.model_fields
    values: dict[str, Any] = {}
    known = set()
    for name, info in fields.items():
        key = info.alias or name
        known.add(key)
        if key not in data:
            if info.is_required():
                _error(errors, (*loc, key), "missing", "Field required")
            else:
                values[name] = info.get_default()
            continue
        value = _checked(info.annotation, info.metadata, data[key], (*loc, key), errors)
        for check in cls._field_checks.get(name, ()):
            if value is not _BAD:
                value = _ran(check, value, (*loc, key), errors)
        if value is not _BAD:
            values[name] = value
    for key in data:
        if not isinstance(key, str):  # (YAML's `1:` or `true:`)
            _error(errors, (*loc, int(key) if isinstance(key, bool) else key), "invalid_key", "Keys should be strings")
        elif key not in known:
            _error(errors, (*loc, key), "extra_forbidden", "Extra inputs are not permitted")
    return values


def _value_error(loc: Loc, error: ValueError) -> dict[str, Any]:
    return {"type": "value_error", "loc": loc, "msg": f"Value error, {error}", "ctx": {"error": error}}


def _check(annotation: Any, value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    if get_origin(annotation) is Annotated:
        base, *metadata = get_args(annotation)
        return _checked(base, tuple(metadata), value, loc, errors)
    return _checked(annotation, (), value, loc, errors)


def _checked(annotation: Any, metadata: tuple[Any, ...], value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    """`value` as `annotation` takes it: the `BeforeValidator`s (the last first), the type, then the
    constraints and `AfterValidator`s in their order."""
    for step in reversed(metadata):
        if isinstance(step, BeforeValidator) and value is not _BAD:
            value = _ran(step.func, value, loc, errors)
    if value is not _BAD:
        value = _typed(annotation, value, loc, errors, metadata)
    for step in metadata:
        if value is _BAD:
            return _BAD
        if isinstance(step, FieldInfo):
            value = step.constrained(value, loc, errors)
        elif isinstance(step, AfterValidator):
            value = _ran(step.func, value, loc, errors)
    return value


def _ran(func: Callable[[Any], Any], value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    """What a validator makes of `value`; `_BAD` where it raises ValueError, told at `loc`."""
    try:
        return func(value)
    except ValueError as error:
        errors.append(_value_error(loc, error))
        return _BAD


def _checks_hold(made: Model, loc: Loc, errors: list[dict[str, Any]]) -> bool:
    """Whether the model's own checks (`model_validator`) hold, the first that fails told at `loc`."""
    return all(_ran(check, made, loc, errors) is not _BAD for check in type(made)._model_checks)


def _picks(step: Any) -> bool:
    """Whether `step`, a piece of a union's metadata, says which member a value is."""
    return isinstance(step, Discriminator) or (isinstance(step, FieldInfo) and step.discriminator is not None)


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_WHOLE = re.compile(r"([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?")
"""A whole number as text (`5`, `+5`, `1_000`, `5.0`); ASCII digits only, as pydantic reads them."""
_INT_RANGE = 2**63
"""Past it, a float is no integer pydantic reads (it says the number is too large)."""
_SCALARS = (str, int, float, bool, SecretStr)


def _typed(annotation: Any, value: Any, loc: Loc, errors: list[dict[str, Any]], metadata: tuple[Any, ...]) -> Any:
    if isinstance(value, bytes) and annotation in _SCALARS:  # (YAML's `!!binary`, read as its text)
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return _error(
                errors,
                loc,
                "string_unicode",
                "Input should be a valid string, unable to parse raw data as a unicode string",
            )
    if annotation is str:
        if isinstance(value, str):
            return value
        return _error(errors, loc, "string_type", "Input should be a valid string")
    if annotation is int:
        return _integer(value, loc, errors)
    if annotation is float:
        return _number(value, loc, errors)
    if annotation is bool:
        return _boolean(value, loc, errors)
    if annotation is Decimal:
        return _decimal(value, loc, errors)
    if annotation is SecretStr:
        if isinstance(value, SecretStr):
            return value
        if isinstance(value, str):
            return SecretStr(value)
        return _error(errors, loc, "string_type", "Input should be a valid string")
    if isinstance(annotation, _ModelType):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            return _error(
                errors,
                loc,
                "model_type",
                f"Input should be a valid dictionary or instance of {annotation.__name__}",
                class_name=annotation.__name__,
            )
        return _made(annotation, value, loc, errors)
    origin = get_origin(annotation)
    if origin is Literal:
        return _literal(get_args(annotation), value, loc, errors)
    if origin is tuple:
        if not isinstance(value, list | tuple | set | frozenset):
            return _error(errors, loc, "tuple_type", "Input should be a valid tuple")
        item, before, kept = get_args(annotation)[0], len(errors), []
        bounds = [step for step in metadata if isinstance(step, FieldInfo)]
        for n, each in enumerate(value):  # (the length is judged on the items that hold, as pydantic does)
            if (made := _check(item, each, (*loc, n), errors)) is _BAD:
                continue
            kept.append(made)
            if any(bound.max_length is not None and len(kept) > bound.max_length for bound in bounds):
                del errors[before:]  # (the first item held past the bound ends the reading: too long, alone)
                for bound in bounds:
                    bound.constrained(tuple(value), loc, errors)
                return _BAD
        held = tuple(kept)
        if len(held) < len(value):
            for bound in bounds:
                if bound.min_length is not None and len(held) < bound.min_length:
                    bound.constrained(held, loc, errors)
            return _BAD
        return held
    if origin is dict:
        if not isinstance(value, dict):
            return _error(errors, loc, "dict_type", "Input should be a valid dictionary")
        key_type, value_type = get_args(annotation)
        pairs = [
            (_check(key_type, key, (*loc, key, "[key]"), errors), _check(value_type, each, (*loc, key), errors))
            for key, each in value.items()
        ]
        return _BAD if any(_BAD in pair for pair in pairs) else dict(pairs)
    if origin in (Union, UnionType):
        members = [m for m in get_args(annotation) if m is not type(None)]
        if value is None and len(members) < len(get_args(annotation)):
            return None
        picks = next((m for m in metadata if _picks(m)), None)
        if picks is not None:
            return _picked(members, picks, value, loc, errors)
        if len(members) == 1:
            return _check(members[0], value, loc, errors)
        tried: list[dict[str, Any]] = []
        for member in members:
            found: list[dict[str, Any]] = []
            made = _check(member, value, loc, found)
            if not found:
                return made
            tried += found
        errors += tried
        return _BAD
    raise TypeError(f"a model field cannot be {annotation!r}")


def _made(cls: _ModelType, data: dict[Any, Any], loc: Loc, errors: list[dict[str, Any]]) -> Any:
    before = len(errors)
    values = _fill(cls, data, loc, errors)
    if len(errors) > before:
        return _BAD
    made = _rebuilt(cls, values)
    return made if _checks_hold(made, loc, errors) else _BAD


def _picked(members: list[Any], picks: Any, value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    """The member of a tagged union that `picks` names for `value`, checked with its tag in `loc`."""
    if isinstance(picks, Discriminator):
        tags = {tag: member for member in members for tag in _tags_of(member)}
        tag = picks.func(value)
        if tag is None or tag not in tags:
            return _error(errors, loc, "union_tag_not_found", "Unable to extract tag using discriminator")
        return _check(tags[tag], value, (*loc, tag), errors)
    key = picks.discriminator
    tags = {tag: member for member in members for tag in get_args(member.model_fields[key].annotation)}
    if isinstance(value, tuple(members)):  # (one made already)
        return value
    # (an object without the key, as pydantic reads one: a YAML float, which has attributes, is one)
    if (isinstance(value, dict) and key not in value) or (hasattr(value, "__dict__") and not hasattr(value, key)):
        told = f"'{key}'"
        return _error(
            errors, loc, "union_tag_not_found", f"Unable to extract tag using discriminator {told}", discriminator=told
        )
    if not isinstance(value, dict):
        return _error(
            errors, loc, "model_attributes_type", "Input should be a valid dictionary or object to extract fields from"
        )
    tag = value[key]
    expected = ", ".join(repr(each) for each in tags)
    if not isinstance(tag, str) or tag not in tags:
        return _error(
            errors,
            loc,
            "union_tag_invalid",
            f"Input tag '{tag}' found using '{key}' does not match any of the expected tags: {expected}",
            discriminator=f"'{key}'",
            tag=str(tag),
            expected_tags=expected,
        )
    return _check(tags[tag], value, (*loc, tag), errors)


def _tags_of(member: Any) -> tuple[str, ...]:
    if get_origin(member) is Annotated:
        return tuple(m.tag for m in get_args(member)[1:] if isinstance(m, Tag))
    return ()


def _literal(expected: tuple[Any, ...], value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    for each in expected:
        if value == each and type(value) is type(each):
            return each
    written = [repr(each) for each in expected]
    told = written[0] if len(written) == 1 else f"{', '.join(written[:-1])} or {written[-1]}"
    return _error(errors, loc, "literal_error", f"Input should be {told}", expected=told)


def _integer(value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    too_large = "Unable to parse input string as an integer, exceeded maximum size"
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return _error(errors, loc, "finite_number", "Input should be a finite number")
        if abs(value) >= _INT_RANGE:
            return _error(errors, loc, "int_parsing_size", too_large)
        if value.is_integer():
            return int(value)
        return _error(
            errors, loc, "int_from_float", "Input should be a valid integer, got a number with a fractional part"
        )
    if isinstance(value, str):
        if whole := _WHOLE.fullmatch(value.strip()):
            try:
                return int(whole[1])
            except ValueError:  # (past the digits Python reads into an int)
                return _error(errors, loc, "int_parsing_size", too_large)
        return _error(
            errors, loc, "int_parsing", "Input should be a valid integer, unable to parse string as an integer"
        )
    return _error(errors, loc, "int_type", "Input should be a valid integer")


def _number(value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # (an integer past any float)
            return _error(errors, loc, "float_type", "Input should be a valid number")
    if isinstance(value, str):
        try:
            if not value.isascii():  # (digits of other scripts, which `float` reads and pydantic does not)
                raise ValueError(value)
            return float(value.strip())
        except ValueError:
            return _error(
                errors, loc, "float_parsing", "Input should be a valid number, unable to parse string as a number"
            )
    return _error(errors, loc, "float_type", "Input should be a valid number")


def _boolean(value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, int | float | str):
        return _error(errors, loc, "bool_parsing", "Input should be a valid boolean, unable to interpret input")
    return _error(errors, loc, "bool_type", "Input should be a valid boolean")


def _decimal(value: Any, loc: Loc, errors: list[dict[str, Any]]) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        return _error(
            errors, loc, "decimal_type", "Decimal input should be an integer, float, string or Decimal object"
        )
    try:
        number = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except InvalidOperation:
        return _error(errors, loc, "decimal_parsing", "Input should be a valid decimal")
    if not number.is_finite():
        return _error(errors, loc, "finite_number", "Input should be a finite number")
    return number
