"""One serializer for the records ranks exchange through files (the lease, a culprit, the
placement): a frozen dataclass to a JSON-ready dict and back, by msgspec.

Decoding checks every field's type against the dataclass (a tuple field accepts the JSON
list, an enum field its value), so a record that does not fit raises ``ValueError`` naming
the field instead of travelling on half-read. Records written by older versions decode as
long as their fields are a superset of the required ones (unknown fields are ignored).
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_ONE_AT_A_TIME = threading.Lock()
"""msgspec (0.22) builds a record type's conversion info on its first use, calling back into
Python half-way; another thread converting the same type meanwhile can crash the process
(SIGSEGV). A rank converts records on its main, heartbeat and monitor threads: one call at a
time (they hold the GIL anyway)."""


def to_dict(record: Any) -> dict:
    """``record`` (a dataclass) as plain JSON values: tuples become lists, enums their values,
    map keys strings (as JSON holds them, so that the checksum a reader computes matches)."""
    with _ONE_AT_A_TIME:
        return msgspec.json.decode(msgspec.json.encode(record))


def from_dict(data: Any, kind: type[T], *, str_keys: bool = False) -> T:
    """The ``kind`` record in ``data``; ``ValueError`` naming the field when it does not fit.
    ``str_keys``: JSON wrote the record's int-keyed maps with string keys; read them back."""
    try:
        with _ONE_AT_A_TIME:
            return msgspec.convert(data, kind, strict=not str_keys)
    except msgspec.ValidationError as e:
        raise ValueError(f"not a valid {kind.__name__} record: {e}") from None
