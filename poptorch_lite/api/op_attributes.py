"""PopTorch's `Attribute` scope: PopART attributes for the ops a model makes inside it, such as
`poptorch.Attribute(__outline={"layer": "encoder"})`, which groups ops for PopART's outlining
(code reuse between identical subgraphs). The emulator keeps one copy of code per op and has no
outlining pass, so these attributes change neither values nor cycles; the scope keeps PopTorch's
nesting rules (an inner scope adds to the outer one's attributes and restores them on exit) and
its current attributes can be read (`Attribute.current()`)."""
from __future__ import annotations

import copy


class Attribute:
    """`with poptorch.Attribute(**{name: {key: value}}):` sets PopART attributes for the ops made
    inside; each keyword is an attribute group (a dict of attribute names to values)."""
    _current: dict = {}

    def __init__(self, **kwargs):
        for name, values in kwargs.items():
            if not isinstance(values, dict):
                raise ValueError(f"poptorch.Attribute: {name} must be a dict of attribute names to values, "
                                 f"got {type(values).__name__}")
        self._kwargs = kwargs
        self._saved: dict = {}

    def __enter__(self):
        self._saved = copy.deepcopy(Attribute._current)
        for name, values in self._kwargs.items():
            Attribute._current.setdefault(name, {}).update(values)
        return self

    def __exit__(self, exc_type, exc, tb):
        Attribute._current = self._saved
        return False

    @staticmethod
    def current() -> dict:
        """The attributes in force (a copy)."""
        return copy.deepcopy(Attribute._current)
