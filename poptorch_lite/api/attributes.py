"""Attribute sets handed to the compiler by reference: PopTorch's ``accessAttributes``.

PopTorch passes the attributes of a custom op or an ``Attribute`` scope to its compiler as a
string, ``"attr:<hex id>"`` (or as JSON); ``accessAttributes`` turns the string back into the
dictionary. Here :func:`attributes_id` registers a dictionary (kept alive while registered) and
gives its string; :func:`release` forgets it.
"""
from __future__ import annotations

import json

ATTR_PREFIX = "attr:"
_REGISTERED: dict[int, dict] = {}


def attributes_id(attributes: dict | None) -> str:
    """The string that names `attributes` for ``accessAttributes``."""
    if attributes is not None and not isinstance(attributes, dict):
        raise TypeError(f"attributes must be a dict or None, got {type(attributes).__name__}")
    _REGISTERED[id(attributes)] = attributes
    return f"{ATTR_PREFIX}{id(attributes):x}"


def release(attribute_id_str: str) -> None:
    """Forget the attributes a string from :func:`attributes_id` names."""
    _REGISTERED.pop(_number(attribute_id_str), None)


def _number(attribute_id_str: str) -> int:
    try:
        return int(attribute_id_str[len(ATTR_PREFIX):], 16)
    except ValueError:
        raise ValueError(f"Invalid attribute_id_str {attribute_id_str!r}: expected 'attr:<hex>'") from None


def accessAttributes(attribute_id_str: str) -> dict:  # pylint: disable=invalid-name
    """The attributes named by `attribute_id_str`: a JSON object (``"{...}"``) or an
    ``"attr:<hex>"`` string from :func:`attributes_id` ({} for registered None)."""
    if not isinstance(attribute_id_str, str):
        raise ValueError("Wrong type for attribute_id_str: expected a str, got "
                         f"{type(attribute_id_str).__name__}")
    if attribute_id_str.startswith("{"):
        return json.loads(attribute_id_str)
    if not attribute_id_str.startswith(ATTR_PREFIX):
        raise ValueError(f"Invalid attribute_id_str {attribute_id_str!r}: expected JSON or 'attr:<hex>'")
    number = _number(attribute_id_str)
    if number not in _REGISTERED:
        raise ValueError(f"Invalid attribute_id_str {attribute_id_str!r}: no attributes registered under it")
    attributes = _REGISTERED[number]
    return {} if attributes is None else attributes
