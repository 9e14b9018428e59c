"""The base of the device commands' declared types and the checks they share
(gpu_worker/contract/commands.py has the types)."""
from __future__ import annotations

import msgspec

from . import ids
from .errors import ServiceError

# fields that hold a resource ID: a value of the wrong type is a 400 `bad_id`, as a malformed one is
ID_FIELDS = frozenset(("participant", "space", "conversation", "operation", "memory", "source"))


class Args(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A device command's arguments (a frame's `args` map)."""

    @classmethod
    def error_code(cls, field: str | None) -> str:
        """The code of a refusal of `field`'s type (None: of the map itself)."""
        return "bad_id" if field in ID_FIELDS else "bad_field"

    @classmethod
    def before(cls, raw: dict[str, object]) -> None:
        """Checks of the map before its values are read: null is never a value (an optional
        argument is left out, and null where a value belongs is refused, as a client's JSON null is)."""
        if None not in raw.values():  # (the common case, answered in C)
            return
        for name, value in raw.items():
            if value is None:
                raise ServiceError(400, cls.error_code(name), f"{name} must not be null (leave it out)")


# ---- the checks the types share ---------------------------------------------------------------

def resource_id(value: object, prefix: str) -> str:
    """A resource ID of this prefix; 400 `bad_id` otherwise (never a lookup of garbage)."""
    if type(value) is not str or not ids.ID_REGEX[prefix].match(value):
        raise ServiceError(400, "bad_id", f"{value!r} is not a valid ID ({ids.shape(prefix)}, lowercase hex)")
    return value


_ZERO32 = "0" * 32


def hex32(value: object, field: str, *, nonzero: bool = False) -> str:
    if type(value) is not str or not ids.HEX32.match(value):
        raise ServiceError(400, "bad_field", f"{field} must be 32 lowercase hexadecimal digits")
    if nonzero and value == _ZERO32:  # (lowercase hex by now: zero is one string)
        raise ServiceError(400, "bad_field", f"{field} must be nonzero")
    return value


def counter(value: object, field: str, *, least: int = 0) -> int:
    """A counter as the device holds it: an integer least..2**63-1 (the gateway parses the
    decimal string a client sends)."""
    if type(value) is not int or not least <= value <= ids.MAX_COUNTER:
        raise ServiceError(400, "bad_field", f"{field} must be a decimal counter of at least {least}")
    return value


def decimal(value: object, field: str, *, least: int = 0,
            what: str = "a decimal string without leading zeros") -> str:
    """A counter written as clients write it: a decimal string without leading zeros, least..2**63-1
    (19 digits pass the pattern beyond the bound: refused here, as every counter is)."""
    if type(value) is not str or not ids.COUNTER.match(value) or not least <= int(value) <= ids.MAX_COUNTER:
        raise ServiceError(400, "bad_field", f"{field} must be {what}")
    return value


def one_of(value: object, field: str, allowed: tuple[str, ...], code: str = "bad_field") -> None:
    if value not in allowed:
        raise ServiceError(400, code, f"{field} must be one of {', '.join(allowed)}")


def number_in(value: object, field: str, low: float, high: float, *, open_low: bool = False,
              code: str = "bad_field") -> None:
    if (type(value) not in (int, float) or not (low < value if open_low else low <= value)  # type: ignore[operator]
            or not value <= high):  # type: ignore[operator]
        bound = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise ServiceError(400, code, f"{field} must be a number in {bound}")


def integer(value: object, field: str, low: int, high: int, code: str = "bad_field") -> None:
    """An optional integer field, when given, is a JSON integer (not a float or a bool) low..high."""
    if value is not None and (type(value) is not int or not low <= value <= high):
        raise ServiceError(400, code, f"{field} must be an integer {low}..{high}")
