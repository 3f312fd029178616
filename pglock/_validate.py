"""Validation of the values leases and semaphores store (TTLs, holder ids, metadata), before
any SQL: each error says what was wrong and what is accepted."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from ._contract import MAX_TTL
from ._keys import exact

#: The largest metadata accepted, in bytes of compact JSON (UTF-8).
MAX_METADATA_BYTES = 65536
#: The longest holder id accepted, in UTF-8 bytes.
MAX_HOLDER_BYTES = 256


def validate_ttl(
    ttl: object, hint: str = "keep a long job's lease alive with keepalive or extend()"
) -> float:
    """A TTL in seconds: a finite number ``0 < ttl <= MAX_TTL`` (not a bool); ``hint`` says
    what to do instead of a longer one."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    try:
        value = float(ttl := exact(ttl))
    except OverflowError:
        value = math.inf
    if math.isnan(value):
        raise ValueError("ttl must be a number of seconds, not NaN")
    if value <= 0:
        raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
    if math.isinf(value) or value > MAX_TTL:
        raise ValueError(
            f"ttl must be at most {MAX_TTL:.0f} seconds (one day), got {ttl!r}; {hint}"
        )
    return value


def validate_holder(holder: object) -> str:
    """A holder id: a non-empty ``str`` of at most :data:`MAX_HOLDER_BYTES` UTF-8 bytes."""
    if not isinstance(holder, str):
        raise TypeError(f"holder must be a str, not {type(holder).__name__}")
    holder = exact(holder)
    if not holder:
        raise ValueError("holder must not be empty")
    if "\x00" in holder:
        raise ValueError("holder must not contain NUL (\\x00) characters")
    try:
        size = len(holder.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("holder must be valid Unicode text (no lone surrogates)") from None
    if size > MAX_HOLDER_BYTES:
        raise ValueError(f"holder must be at most {MAX_HOLDER_BYTES} bytes in UTF-8, got {size}")
    return holder


def encode_metadata(metadata: object) -> str | None:
    """Compact JSON text of ``metadata`` (None stays None), checked as jsonb will check it,
    made of plain values: see :func:`_plain`."""
    if metadata is None:
        return None
    value = _plain(metadata, ())
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except TypeError as exc:
        raise TypeError(f"metadata must be JSON-serializable: {exc}") from None
    except ValueError as exc:  # NaN/Infinity
        raise ValueError(f"metadata must be valid JSON: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON, got {size}")
    return text


def _plain(value: object, within: tuple[int, ...]) -> object:
    """``value`` by value, keys included (:func:`pglock._keys.exact`; a Mapping: a dict, a
    tuple: a list): json.dumps would call a subclass's own methods. Strings are checked as
    jsonb checks them: json.dumps lets NUL and unpaired surrogates through."""
    value = exact(value)
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("metadata strings must not contain NUL (\\x00): jsonb refuses it")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("metadata strings must be valid Unicode text") from None
    elif isinstance(value, (Mapping, list, tuple)):
        if id(value) in within:
            raise ValueError("metadata must be valid JSON: it contains itself")
        within += (id(value),)
        if isinstance(value, Mapping):
            # A key that is not a str stays one json.dumps refuses (a tuple is no list here).
            return {
                _plain(k, within) if isinstance(k, str) else exact(k): _plain(v, within)
                for k, v in value.items()
            }
        return [_plain(v, within) for v in value]
    return value
