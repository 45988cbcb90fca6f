"""Event base class, validation and the orjson codec.

Contract:
- Every event is a frozen, slotted, keyword-only dataclass deriving from `Event`,
  with a class attribute `NAME` (the design card's subject name, e.g.
  ``"call.completed"``) and the fields `event_id`, `schema_version`, `emitted_at`.
- `encode(event) -> bytes` (orjson) and `decode(name, data) -> Event` round-trip.
  Decoding validates every field against its annotation and raises `SchemaError`
  naming the bad field and value; unknown fields are ignored (forward compatibility).
- Only the standard library and orjson are imported here (a test enforces it).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import types
import typing
from typing import Any, ClassVar

import orjson

SCHEMA_VERSION = 1

_REGISTRY: dict[str, type["Event"]] = {}


class SchemaError(ValueError):
    """An event could not be decoded or failed validation.

    Attributes: `name` (event name or None), `field` (offending field or None), `value`.
    """

    def __init__(self, message: str, *, name: str | None = None, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.name = name
        self.field = field
        self.value = value


def utc_now() -> str:
    """Current UTC time as an ISO-8601 string with microseconds and a `Z` suffix."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")[:-6] + "Z"


def register(cls: type["Event"]) -> type["Event"]:
    """Class decorator: makes `cls` decodable by its `NAME`."""
    if cls.NAME in _REGISTRY and _REGISTRY[cls.NAME] is not cls:
        raise RuntimeError(f"event name {cls.NAME!r} registered twice")
    _REGISTRY[cls.NAME] = cls
    return cls


def event_types() -> dict[str, type["Event"]]:
    """All registered event classes by name."""
    return dict(_REGISTRY)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every bus event.

    event_id: deterministic id of the fact (DESIGN.md "Event ids"); sent as Nats-Msg-Id.
    schema_version: version of this event's schema; bumped on incompatible change.
    emitted_at: UTC ISO-8601 time the producer built the event.
    """

    NAME: ClassVar[str] = ""
    event_id: str
    schema_version: int = SCHEMA_VERSION
    emitted_at: str = dataclasses.field(default_factory=utc_now)

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def encode(event: Event) -> bytes:
    """Serialise an event to JSON bytes (orjson, which writes a dataclass's fields in
    order, as `to_dict` lists them). Tuples become lists."""
    return orjson.dumps(event)


def decode(name: str, data: bytes | str | dict) -> Event:
    """Decode and validate an event of type `name`.

    Raises SchemaError on unknown name, malformed JSON, a missing required field or a
    field of the wrong type or value; the message names the field and the value.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise SchemaError(f"unknown event name {name!r}", name=name)
    if isinstance(data, dict):
        obj = data
    else:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise SchemaError(f"{name}: payload is not JSON ({exc})", name=name) from None
    if not isinstance(obj, dict):
        raise SchemaError(f"{name}: payload must be a JSON object, got {type(obj).__name__}", name=name)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in obj.items() if k in known}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SchemaError(f"{name}: missing field {missing[0]!r}", name=name, field=missing[0])
    hints = _hints(cls)
    for key, value in list(kwargs.items()):
        kwargs[key] = _coerce(name, key, value, hints[key])
    try:
        return cls(**kwargs)
    except SchemaError:
        raise
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"{name}: {exc}", name=name) from None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        import sys

        module = sys.modules[cls.__module__]
        _HINTS[cls] = typing.get_type_hints(cls, vars(module))
    return _HINTS[cls]


def _coerce(name: str, field: str, value: Any, hint: Any) -> Any:
    """Convert JSON values into annotation shapes (lists → tuples) and type-check."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, field, value, arg)
            except SchemaError as exc:
                errors.append(exc)
        raise errors[0] if errors else SchemaError(f"{name}.{field}: bad value {value!r}", name=name, field=field, value=value)
    if origin is typing.Literal:
        if value not in args:
            raise SchemaError(f"{name}.{field}: {value!r} is not one of {list(args)}", name=name, field=field, value=value)
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{name}.{field}: expected a list, got {_short(value)}", name=name, field=field, value=value)
        if len(args) == 2 and args[1] is Ellipsis:
            # Fast paths for long token and log-prob arrays.
            if args[0] is int and all(type(v) is int for v in value):
                return tuple(value)
            if args[0] is float and all(type(v) is float for v in value):
                return tuple(value)
            return tuple(_coerce(name, field, v, args[0]) for v in value)
        if len(args) != len(value):
            raise SchemaError(f"{name}.{field}: expected {len(args)} items, got {_short(value)}", name=name, field=field, value=value)
        return tuple(_coerce(name, field, v, a) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{name}.{field}: expected an object, got {_short(value)}", name=name, field=field, value=value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{name}.{field}: expected a boolean, got {_short(value)}", name=name, field=field, value=value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{name}.{field}: expected an integer, got {_short(value)}", name=name, field=field, value=value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{name}.{field}: expected a number, got {_short(value)}", name=name, field=field, value=value)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise SchemaError(f"{name}.{field}: expected a string, got {_short(value)}", name=name, field=field, value=value)
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise SchemaError(f"{name}.{field}: expected an object, got {_short(value)}", name=name, field=field, value=value)
        sub = _hints(hint)
        known = {f.name for f in dataclasses.fields(hint)}
        kw = {k: _coerce(name, f"{field}.{k}", v, sub[k]) for k, v in value.items() if k in known}
        try:
            return hint(**kw)
        except TypeError as exc:
            raise SchemaError(f"{name}.{field}: {exc}", name=name, field=field, value=value) from None
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _validate(event: Event) -> None:
    """Field-level checks common to all events; subclasses add their own in `check`."""
    name = type(event).NAME
    if not event.event_id:
        raise SchemaError(f"{name}.event_id: must be non-empty", name=name, field="event_id", value=event.event_id)
    check = getattr(event, "check", None)
    if check is not None:
        check()


def fail(event: Event, field: str, message: str) -> typing.NoReturn:
    """Raise a SchemaError for `field` of `event` with the offending value."""
    value = getattr(event, field, None)
    raise SchemaError(f"{type(event).NAME}.{field}: {message} (got {_short(value)})", name=type(event).NAME, field=field, value=value)


def as_tuple(value: Any) -> Any:
    """Recursively turn lists into tuples (dataclass fields are immutable)."""
    if isinstance(value, list):
        return tuple(as_tuple(v) for v in value)
    return value


def encode_part(part: Any) -> bytes:
    """Serialise a nested schema dataclass (e.g. CallTokens moved to the object store)."""
    return orjson.dumps(dataclasses.asdict(part))


def decode_part(cls: type, data: bytes) -> Any:
    """Decode and validate a nested schema dataclass written by `encode_part`.

    Raises SchemaError naming the bad field and value.
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"{cls.__name__}: payload is not JSON ({exc})") from None
    return _coerce(cls.__name__, "", obj, cls)
