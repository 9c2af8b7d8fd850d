"""A small functional IR: values produced by nodes, one dataclass each, and passes as functions.

Every node carries where it runs (block, stage, IPU) and what part of training it belongs to
(`pass_`: "fwd", "bwd"). Parameters, buffers and model inputs are values without a producer.
Shapes are those of one micro-batch on one replica.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.arguments import parser_for

_ids = itertools.count()

# Ops whose output is a view of their input (no compute, no memory of their own).
VIEW_OPS = frozenset({"reshape", "transpose", "expand", "slice"})


@dataclass(eq=False)
class Value:
    shape: tuple
    dtype: np.dtype
    name: str = ""
    producer: "Node | None" = None
    kind: str = "activation"      # activation | input | param | buffer | const
    data: np.ndarray | None = None  # constants only
    host_dtype: np.dtype | None = None  # a model input or output the device holds wider (int8 in int32)
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize

    def __repr__(self):
        return f"%{self.name or self.id}:{np.dtype(self.dtype).name}{list(self.shape)}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict = field(default_factory=dict)
    block: str | None = None
    stage: int = 0
    ipu: int = 0
    phase: int | None = None
    pass_: str = "fwd"
    source: str = ""
    aten: str = ""                # the ATen op the node was lowered from ("aten.convolution.default")
    module: str = ""              # the module that made the call ("model.layer1.conv (Conv2d)")
    scope: str = ""               # the NameScopes it was made in ("encoder/attention")

    def __repr__(self):
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs.items())
        outs = ", ".join(map(repr, self.outputs))
        ins = ", ".join(map(repr, self.inputs))
        where = f"stage {self.stage} ipu {self.ipu} {self.pass_}"
        return f"{outs} = {self.op}({ins}{', ' if attrs and ins else ''}{attrs})  # {where}"


@dataclass(eq=False)
class IRGraph:
    nodes: list[Node] = field(default_factory=list)
    inputs: list[Value] = field(default_factory=list)          # model inputs, in call order
    params: dict[str, Value] = field(default_factory=dict)      # torch parameter name -> value
    buffers: dict[str, Value] = field(default_factory=dict)     # torch buffer name -> value
    outputs: object = None                                      # pytree of Values (model outputs)
    loss: Value | None = None
    grads: dict[str, Value] = field(default_factory=dict)       # parameter name -> gradient value
    host_io: dict[tuple, Any] = field(default_factory=dict)     # ("input" | "output", index) -> OverlapMode
    # node outputs are named by op and a number counted per graph: the same model compiled twice
    # in one process gets the same names (profiles, memory reports)
    numbers: Any = field(default_factory=itertools.count, repr=False)
    input_updates: list[tuple[int, Value]] = field(default_factory=list)  # (input index, new value): in place

    def returned(self) -> list[Value]:
        """What the device sends to the host each call: the model's outputs, then the new values
        of the inputs it changed in place (copied into the caller's tensors)."""
        return flatten_values(self.outputs) + [v for _, v in self.input_updates]

    def add(self, op: str, inputs: list[Value], out_specs: list[tuple], /, *, like: Node | None = None,
            **attrs) -> list[Value]:
        """Append a node; `out_specs` are (shape, dtype) pairs; placement copied from `like`."""
        outs = [Value(tuple(int(d) for d in shape), np.dtype(dtype), f"{op}{next(self.numbers)}") for shape, dtype in out_specs]
        node = Node(op, list(inputs), outs, attrs)
        if like is not None:
            node.block, node.stage, node.ipu, node.phase = like.block, like.stage, like.ipu, like.phase
            node.pass_, node.source, node.aten, node.module = like.pass_, like.source, like.aten, like.module
            node.scope = like.scope
        for v in outs:
            v.producer = node
        self.nodes.append(node)
        return outs

    def consumers(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v.id, []).append(n)
        return out

    def __str__(self):
        lines = [f"inputs: {self.inputs}", f"params: {list(self.params.values())}"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines.append(f"outputs: {self.outputs}")
        if self.loss is not None:
            lines.append(f"loss: {self.loss!r}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Custom:
    """A value of a type with a registered ``ICustomArgParser`` in a tree of outputs: its tensors
    (one subtree each, in the parser's order) and the template the parser rebuilds it from."""
    parser: Any
    template: Any
    items: tuple

    def __repr__(self):  # no object addresses: the executable cache keys on it
        return f"{type(self.template).__name__}{self.items!r}"


def flatten_values(tree, kind: type = Value) -> list:
    """The leaves of type `kind` (default Value) of a tree of tuples (namedtuples too), lists,
    dicts (OrderedDict and other subclasses too) and custom types, in order."""
    if isinstance(tree, kind):
        return [tree]
    if isinstance(tree, Custom):
        return flatten_values(tree.items, kind)
    parser = parser_for(tree)
    if parser is not None:
        return flatten_values(list(parser.yieldTensors(tree)), kind)
    if isinstance(tree, (tuple, list)):
        return [v for t in tree for v in flatten_values(t, kind)]
    if isinstance(tree, dict):
        return [v for t in tree.values() for v in flatten_values(t, kind)]
    return []


def map_values(tree, fn, kind: type = Value, *, rebuild: bool = False):
    """The tree rebuilt, containers of the same types, with fn applied to every leaf of type `kind`.
    A value of a custom type becomes a :class:`Custom` of its mapped tensors; with `rebuild`, its
    parser makes it a value of its type again."""
    if isinstance(tree, kind):
        return fn(tree)
    parser = parser_for(tree)
    if parser is not None:
        items = list(parser.yieldTensors(tree))
        tree = Custom(parser, parser.reconstruct(tree, iter([None] * len(items))), tuple(items))
    if isinstance(tree, Custom):
        items = tuple(map_values(t, fn, kind, rebuild=rebuild) for t in tree.items)
        return tree.parser.reconstruct(tree.template, iter(items)) if rebuild else \
            Custom(tree.parser, tree.template, items)
    if isinstance(tree, tuple):
        items = [map_values(t, fn, kind, rebuild=rebuild) for t in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)  # namedtuples too
    if isinstance(tree, list):
        return type(tree)(map_values(t, fn, kind, rebuild=rebuild) for t in tree)
    if isinstance(tree, dict):
        # OrderedDict and subclasses too
        return type(tree)((k, map_values(t, fn, kind, rebuild=rebuild)) for k, t in tree.items())
    return tree
