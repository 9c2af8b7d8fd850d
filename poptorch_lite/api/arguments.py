"""The arguments of a model call: where its tensors are, and whether a later call matches the first.

A model is called as its `forward` is: positional and keyword arguments, defaults, `*args` and
`**kwargs`, tensors nested in tuples, lists and dicts, objects of a type with a registered
`ICustomArgParser`, and values that are not tensors (None, numbers, strings). :func:`bind` binds a
call to `forward`'s signature (defaults filled in) and finds its tensors in a fixed order: the
parameters in signature order, tuple and list items in order, dict items in the order of the
call that compiled the model, a custom object's tensors in its parser's order. Those tensors are
the model's inputs on the device; everything else is fixed when the model is compiled.

Every later call must have the same structure: the same tensors (shape and dtype) in the same
places and the same other values. :meth:`CallArguments.match` checks a new call against the
compiled one and returns its tensors in the compiled order (a dict given in another order is
fine); a difference is a `poptorch.Error` naming the argument and what changed.
"""
from __future__ import annotations

import abc
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .errors import Error


class ICustomArgParser(abc.ABC):
    """How to find the tensors of a custom argument type and rebuild it around other tensors.
    Register one with :func:`registerCustomArgParser`."""

    @abc.abstractmethod
    def yieldTensors(self, struct) -> Iterator[torch.Tensor]:
        """Yield every tensor of `struct`, always in the same order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator) -> Any:
        """A copy of `original_structure` holding the tensors of `tensor_iterator` instead of
        its own, taken in the order of :meth:`yieldTensors`."""


_PARSERS: Dict[type, ICustomArgParser] = {}


def registerCustomArgParser(arg_data_type: type, arg_parser: Optional[ICustomArgParser]) -> None:
    """Use `arg_parser` for arguments of type `arg_data_type` (and its subclasses); None removes
    the type's parser."""
    if arg_parser is None:
        _PARSERS.pop(arg_data_type, None)
        return
    if not isinstance(arg_parser, ICustomArgParser):
        raise Error(f"registerCustomArgParser: the parser of {arg_data_type.__name__} must be an "
                    f"instance of a subclass of poptorch.ICustomArgParser, got {type(arg_parser).__name__}")
    _PARSERS[arg_data_type] = arg_parser


def parser_for(value) -> Optional[ICustomArgParser]:
    """The parser registered for `value`'s type, or for the nearest registered base class."""
    parser = _PARSERS.get(type(value))
    if parser is None:
        for cls in type(value).__mro__[1:]:
            if cls in _PARSERS:
                return _PARSERS[cls]
    return parser


# ---- structure of one argument -------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    shape: torch.Size
    dtype: torch.dtype


@dataclass(frozen=True)
class Sequence:
    kind: type                  # tuple, list or a namedtuple class
    items: Tuple[Any, ...]


@dataclass(frozen=True)
class Mapping:
    kind: type
    items: Tuple[Tuple[Any, Any], ...]   # (key, spec) in the compiled call's order


@dataclass(frozen=True)
class Custom:
    kind: type
    parser: ICustomArgParser
    items: Tuple[Any, ...]      # the specs of the parser's tensors


@dataclass(frozen=True)
class Constant:
    value: Any


def _spec(value):
    if isinstance(value, torch.Tensor):
        return TensorSpec(value.shape, value.dtype)
    if isinstance(value, torch.nn.utils.rnn.PackedSequence):
        raise Error("a PackedSequence input: variable-length (packed) sequences are not supported on the IPU, as in "
                    "PopTorch (their shapes depend on the data). Pad the sequences to one length "
                    "(torch.nn.utils.rnn.pad_sequence) and pass the padded tensor")
    parser = parser_for(value)
    if parser is not None:
        return Custom(type(value), parser, tuple(_spec(t) for t in parser.yieldTensors(value)))
    if isinstance(value, (tuple, list)):
        return Sequence(type(value), tuple(_spec(v) for v in value))
    if isinstance(value, dict):
        return Mapping(type(value), tuple((k, _spec(v)) for k, v in value.items()))
    return Constant(value)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor of {value.dtype} {value.shape}"
    return repr(value)


def _match(spec, value, name: str, out: List[Tuple[str, torch.Tensor]]) -> None:
    """Append the tensors of `value` in the order of `spec` to `out`, named after their place."""
    if isinstance(spec, TensorSpec):
        if not isinstance(value, torch.Tensor):
            raise Error(f"Type mismatch for {name}: expected torch.Tensor but got {_describe(value)}")
        if value.dtype != spec.dtype:
            raise Error(f"Type mismatch for {name}: expected {spec.dtype} but got {value.dtype}. The model was "
                        "compiled for the first call's dtypes: cast the input, or destroy() the model to compile "
                        "it again")
        if value.shape != spec.shape:
            raise Error(f"Shape mismatch for {name}: expected {spec.shape} but got {value.shape}. The model was "
                        "compiled for the first call's shapes: pass the same shapes, or destroy() the model to "
                        "compile it again")
        out.append((name, value))
    elif isinstance(spec, Custom):
        if not isinstance(value, spec.kind):
            raise Error(f"Type mismatch for {name}: expected {spec.kind.__name__} but got {_describe(value)}")
        tensors = list(spec.parser.yieldTensors(value))
        if len(tensors) != len(spec.items):
            raise Error(f"Number of tensors mismatch for {name}: expected {len(spec.items)} but its parser "
                        f"yields {len(tensors)}")
        for i, (s, t) in enumerate(zip(spec.items, tensors)):
            _match(s, t, f"{name}[{i}]", out)
    elif isinstance(spec, Sequence):
        if not isinstance(value, (tuple, list)):
            raise Error(f"Type mismatch for {name}: expected {spec.kind.__name__} but got {_describe(value)}")
        if len(value) != len(spec.items):
            raise Error(f"Length mismatch for {name}: expected {len(spec.items)} items but got {len(value)}")
        for i, (s, v) in enumerate(zip(spec.items, value)):
            _match(s, v, f"{name}[{i}]", out)
    elif isinstance(spec, Mapping):
        if not isinstance(value, dict):
            raise Error(f"Type mismatch for {name}: expected {spec.kind.__name__} but got {_describe(value)}")
        _match_keys([k for k, _ in spec.items], value, f" (in {name})")
        for k, s in spec.items:
            _match(s, value[k], f"{name}[{k!r}]", out)
    elif isinstance(value, torch.Tensor) or type(value) is not type(spec.value) or value != spec.value:
        what = "Type" if type(value) is not type(spec.value) else "Value"
        raise Error(f"{what} mismatch for {name}: expected {_describe(spec.value)} but got {_describe(value)}. "
                    "Arguments that are not tensors are fixed when the model is compiled: destroy() the model "
                    "to compile it for other values")


def _match_keys(expected: list, value: dict, where: str) -> None:
    missing = [k for k in expected if k not in value]
    if missing:
        raise Error(f"Missing arguments: {', '.join(map(str, missing))}.{where} The model was compiled with them")
    unexpected = [k for k in value if k not in expected]
    if unexpected:
        raise Error(f"Unexpected arguments: {', '.join(map(str, unexpected))}.{where} The model was compiled "
                    "without them")


def _rebuild(value, tensors: Iterator):
    """`value` with each of its tensors replaced by the next of `tensors`, in the order of `_spec`."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    parser = parser_for(value)
    if parser is not None:
        return parser.reconstruct(value, iter([next(tensors) for _ in parser.yieldTensors(value)]))
    if isinstance(value, (tuple, list)):
        items = [_rebuild(v, tensors) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        rebuilt = type(value)() if type(value) is not dict else {}
        for k, v in value.items():
            rebuilt[k] = _rebuild(v, tensors)
        return rebuilt
    return value


# ---- a whole call --------------------------------------------------------------------------------
class CallArguments:
    """One call of a model bound to its `forward`: its structure, and its tensors in order."""

    def __init__(self, bound: inspect.BoundArguments):
        self._bound = bound
        self._specs = {name: _spec(value) for name, value in bound.arguments.items()}
        self.tensors = self._tensors_of(bound)

    def _tensors_of(self, bound: inspect.BoundArguments) -> List[Tuple[str, torch.Tensor]]:
        out: List[Tuple[str, torch.Tensor]] = []
        for name, spec in self._specs.items():
            value = bound.arguments[name]
            if bound.signature.parameters[name].kind == inspect.Parameter.VAR_KEYWORD:
                for key, item in spec.items:  # named as the caller names them
                    _match(item, value[key], str(key), out)
            else:
                _match(spec, value, name, out)
        return out

    @property
    def names(self) -> List[str]:
        """An identifier for each tensor, after its place in the call (`x`, `t_0`, `d_x`, ...)."""
        names, seen = [], set()
        for place, _ in self.tensors:
            name = re.sub(r"\W+", "_", place).strip("_") or "input"
            while name in seen:
                name += "_"
            seen.add(name)
            names.append(name)
        return names

    def with_tensors(self, tensors) -> Tuple[tuple, dict]:
        """`(args, kwargs)` of this call with `tensors` in place of its own, in order."""
        it = iter(tensors)
        arguments = {name: _rebuild(value, it) for name, value in self._bound.arguments.items()}
        bound = inspect.BoundArguments(self._bound.signature, arguments)
        return bound.args, bound.kwargs

    def match(self, args, kwargs, forward: Callable) -> List[Tuple[str, torch.Tensor]]:
        """The tensors of a later call in this call's order; an `Error` if its structure differs."""
        bound = _bind(forward, args, kwargs)
        for name, value in bound.arguments.items():
            spec = self._specs.get(name)
            parameter = bound.signature.parameters[name]
            if parameter.kind == parameter.VAR_POSITIONAL and len(value) != len(spec.items):
                expected = len(self._bound.args)
                raise Error(f"Number of positional arguments mismatch: expected {expected} arguments but got "
                            f"{expected - len(spec.items) + len(value)}")
            if parameter.kind == parameter.VAR_KEYWORD:
                _match_keys([k for k, _ in spec.items], value, "")
        return self._tensors_of(bound)


def _bind(forward: Callable, args, kwargs) -> inspect.BoundArguments:
    signature = inspect.signature(forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        positional = [n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        given = set(positional[:len(args)]) | set(kwargs)
        missing = [n for n, p in signature.parameters.items() if p.default is p.empty and n not in given
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing:
            raise Error(f"Mandatory parameter {missing[0]} missing: {forward.__qualname__}{signature} needs it "
                        f"({error})") from None
        raise Error(f"The call does not match {forward.__qualname__}{signature}: {error}") from None
    bound.apply_defaults()
    return bound


def bind(forward: Callable, args, kwargs) -> CallArguments:
    """Bind a call to `forward` (a bound method, usually `model.forward`), defaults filled in."""
    return CallArguments(_bind(forward, args, kwargs))


def registerGeometricCustomArgParsers() -> None:  # pylint: disable=invalid-name
    """Register PopTorch Geometric's argument parsers (its data and batch types as model
    arguments) when ``poptorch_geometric`` is installed; nothing otherwise."""
    try:
        if importlib.util.find_spec("poptorch_geometric") is None:
            return
        types = importlib.import_module("poptorch_geometric.types")
    except ImportError:
        return
    types.registerCustomArgParsers()
