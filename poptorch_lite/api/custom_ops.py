"""Custom ops: PopTorch's `custom_op` with the op's implementation registered from Python.

In PopTorch a custom op is a C++ PopART op (and its Poplar codelet) loaded from a shared library;
no emulator can load those. Here the program registers the op's implementation under the same
name, domain and version, before the model that uses it is compiled:

    def cube(x, bias):                       # NumPy arrays in, arrays out
        return x * x * x + bias, x * x * x

    def cube_grad(grads, inputs, outputs):   # gradients of the outputs, the op's inputs and outputs
        (g0, g1), (x, _) = grads, inputs
        return (g0 + g1) * 3 * x * x, g0     # one gradient per input (None: no gradient)

    poptorch_lite.register_custom_op("Cube", "com.acme", 1, forward=cube, backward=cube_grad,
                                     cycles=lambda x, bias: 4 * x[-1], partition="rows")

and a model calls it as in PopTorch:

    y, z = poptorch.custom_op([x, bias], "Cube", "com.acme", 1, example_outputs=[x, x])

Inside a model the call is captured as one op and runs on the tiles as one compute set of the
op's own vertex type (`ipusim.ops.custom`): `forward(*inputs, **attributes)` is its codelet,
`cycles(*input_shapes, **attributes)` its cycle estimate per vertex (default: one worker
instruction per element read or written), and `partition` says how the work may be cut over tiles
("none", "rows" or "elements"). In training the op's gradient is a second such op running
`backward(grads, inputs, outputs, **attributes)`. `attributes` reach the kernels as keyword
arguments, checked as PopTorch checks them. An op that is not registered when the model is
compiled is a compile-time error saying how to register it. Outside a model `custom_op` does what
PopTorch's does on the CPU: it returns zeros shaped like `example_outputs`.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.overrides import handle_torch_function, has_torch_function

PARTITIONS = ("none", "rows", "elements")


@dataclass(frozen=True)
class CustomOpDefinition:
    """A registered custom op: its kernels and how they run on the tiles."""
    name: str
    domain: str
    domain_version: int
    forward: Callable
    backward: Optional[Callable] = None
    cycles: Optional[Callable] = None
    backward_cycles: Optional[Callable] = None
    partition: str = "none"

    @property
    def key(self) -> tuple:
        return (self.domain, self.name, self.domain_version)


@dataclass(frozen=True)
class CustomOpCall:
    """One use of a custom op as the capture sees it: which op, its attributes and the shapes and
    dtypes of its outputs (from `example_outputs`)."""
    name: str
    domain: str
    domain_version: int
    attributes: tuple = ()                 # ((key, value), ...) in the order given
    outputs: tuple = ()                    # ((shape, torch dtype), ...)
    requires_grad: tuple = field(default=())

    @property
    def key(self) -> tuple:
        return (self.domain, self.name, self.domain_version)

    @property
    def attribute_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.attributes}

    def describe(self) -> str:
        return f"{self.domain}::{self.name} (version {self.domain_version})"


_REGISTRY: dict[tuple, CustomOpDefinition] = {}
_CALLS: dict[str, CustomOpCall] = {}
_LOCK = threading.Lock()


def register_custom_op(name: str, domain: str, domain_version: int = 1, *, forward: Callable,
                       backward: Optional[Callable] = None, cycles: Optional[Callable] = None,
                       backward_cycles: Optional[Callable] = None, partition: str = "none") -> CustomOpDefinition:
    """Register the implementation of the custom op `domain::name` (version `domain_version`),
    which `poptorch.custom_op` calls by those names. Registering the same op again replaces it
    (for models compiled afterwards).

    - `forward(*inputs, **attributes)`: the op's codelet, on NumPy arrays; returns one array or a
      sequence of arrays, one per output, of the shapes of `example_outputs` (cast to their dtypes).
    - `backward(grads, inputs, outputs, **attributes)`: the gradient op (training only); `grads`
      are the gradients of the outputs, `inputs` and `outputs` the forward's; returns one gradient
      per input, shaped like it, or None for an input without one.
    - `cycles(*input_shapes, **attributes)` / `backward_cycles(*shapes, ...)`: cycles one vertex
      takes on one worker given the shapes of the inputs it connects (the backward's inputs are the
      gradients, then the forward's inputs and outputs); default: one instruction per element read
      or written.
    - `partition`: "none" (one vertex on one tile), "rows" (outputs' row r depends only on the
      inputs' row r: rows spread over tiles and workers) or "elements" (elementwise: elements spread
      likewise). See `ipusim.ops.custom`.
    """
    for what, value in (("name", name), ("domain", domain)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"register_custom_op: {what} must be a non-empty str, got {value!r}")
    if isinstance(domain_version, bool) or not isinstance(domain_version, int):
        raise TypeError(f"register_custom_op: domain_version must be an int, got {domain_version!r}")
    for what, fn in (("forward", forward), ("backward", backward), ("cycles", cycles),
                     ("backward_cycles", backward_cycles)):
        if fn is not None and not callable(fn):
            raise TypeError(f"register_custom_op: {what} must be callable, got {fn!r}")
    if forward is None:
        raise TypeError("register_custom_op: forward (the op's kernel) is required")
    if partition not in PARTITIONS:
        raise ValueError(f"register_custom_op: partition must be one of {PARTITIONS}, got {partition!r}")
    definition = CustomOpDefinition(name, domain, int(domain_version), forward, backward, cycles, backward_cycles,
                                    partition)
    with _LOCK:
        _REGISTRY[definition.key] = definition
    return definition


def unregister_custom_op(name: str, domain: str, domain_version: int = 1) -> None:
    """Forget a registered custom op (a KeyError if it is not registered)."""
    with _LOCK:
        del _REGISTRY[(domain, name, domain_version)]


def registered_custom_op(call: CustomOpCall) -> CustomOpDefinition:
    """The registration a call needs, or a LookupError saying how to register it."""
    definition = _REGISTRY.get(call.key)
    if definition is None:
        versions = sorted(v for d, n, v in _REGISTRY if (d, n) == (call.domain, call.name))
        also = f" (registered versions of it: {versions})" if versions else ""
        raise LookupError(
            f"custom op {call.describe()} is not registered{also}. PopTorch loads a custom op from a C++ "
            f"PopART library; here register its implementation before compiling the model: "
            f"poptorch_lite.register_custom_op({call.name!r}, {call.domain!r}, {call.domain_version}, "
            f"forward=kernel, backward=gradient_kernel) (see help(poptorch_lite.register_custom_op))")
    return definition


def call_spec(key: str) -> CustomOpCall:
    return _CALLS[key]


# ---- PopTorch's custom_op ---------------------------------------------------------------------------
def _check_attributes(attributes) -> tuple:
    """PopTorch's rules for attributes: str keys; float, int or str values, or non-empty lists or
    tuples of one of those; ASCII text only."""
    if attributes is None:
        return ()
    if not isinstance(attributes, dict):
        raise ValueError(f"custom_op attributes must be a dict of str to values, got {type(attributes).__name__}")

    def ascii_only(s):
        if isinstance(s, str) and any(ord(ch) >= 128 for ch in s):
            raise ValueError(f"{s} contains non-ASCII characters.")

    out = []
    for k, v in attributes.items():
        if not isinstance(k, str):
            raise ValueError("All attribute keys must be strings.")
        if isinstance(v, bool) or not isinstance(v, (float, int, str, list, tuple)):
            raise ValueError("Attribute values must be floats, ints, strings or a list/tuple of float, ints of "
                             "strings.")
        if isinstance(v, (list, tuple)):
            if not v:
                raise ValueError(f"Attribute {k!r} is an empty list/tuple: its element type is unknown.")
            if any(not isinstance(e, type(v[0])) or isinstance(e, bool) for e in v) or \
                    not isinstance(v[0], (float, int, str)):
                raise ValueError("The types in a list/tuple attribute must all be the same.")
            for e in v:
                ascii_only(e)
            v = tuple(v)
        ascii_only(k)
        ascii_only(v)
        out.append((k, v))
    return tuple(out)


def _register_call(call: CustomOpCall) -> str:
    key = json.dumps([call.domain, call.name, call.domain_version,
                      [[k, list(v) if isinstance(v, tuple) else v, type(v).__name__] for k, v in call.attributes],
                      [[list(s), str(d)] for s, d in call.outputs], list(call.requires_grad)])
    with _LOCK:
        _CALLS.setdefault(key, call)
    return key


def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str, domain_version: int,
              example_outputs: Sequence[torch.Tensor], attributes: Optional[dict] = None) -> list[torch.Tensor]:
    """Apply the custom op `domain::name` to `inputs`. `example_outputs` give the shapes and dtypes
    of its outputs (their values do not matter); `attributes` (str keys; float, int or str values
    or lists of them) are passed to the registered kernels. Returns the list of outputs. Inside a
    model the op runs its registered kernels on the device (`register_custom_op`); outside a model
    the outputs are zeros, as PopTorch's custom ops give on the CPU."""
    inputs = list(inputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("custom_op: inputs must be a list or tuple of torch.Tensor")
    outputs = list(example_outputs)
    if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs):
        raise TypeError("custom_op: example_outputs must be a non-empty list or tuple of torch.Tensor")
    for what, value in (("name", name), ("domain", domain)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"custom_op: {what} must be a non-empty str, got {value!r}")
    if isinstance(domain_version, bool) or not isinstance(domain_version, int):
        raise TypeError(f"custom_op: domain_version must be an int, got {domain_version!r}")
    call = CustomOpCall(name, domain, int(domain_version), _check_attributes(attributes),
                        tuple((tuple(t.shape), t.dtype) for t in outputs),
                        tuple(bool(t.requires_grad) for t in outputs))
    key = _register_call(call)
    if has_torch_function(inputs):  # captured: the library op poptorch_lite::custom_op(inputs, key)
        return handle_torch_function(custom_op, inputs, inputs, key)
    return [torch.zeros_like(t, requires_grad=t.requires_grad) for t in outputs]

