"""Op templates: what one call of an op library function built, made again for other tensors of
the same structure without planning it again.

A model's repeated layers call the same ops on tensors of the same shapes, views and tile maps:
the plans, vertex tables, exchanges and costs are the same, only the variables differ. `record`
notes the variables and compute sets a graph makes while an op is built; `Template.of` keeps
them with the op's programs and outputs; `Template.replay` makes new variables (same dtype,
shape, tile map, category, liveness), new compute sets whose vertex tables connect the new
variables through the same field arrays, and new program nodes, each knowing the node it copies
(`twin`), so that its static cost is the twin's and not estimated again. An op's whole-tensor
implementation (`OpProgram.fast`) is the same function with its tensors replaced.

`signature(tensors)` is the structure an op's result depends on: for every input view, its
variable's dtype, shape, tile map, category and liveness, the view's offset, shape and strides
(or its element runs), and which inputs share a variable. An op whose template holds anything
it cannot copy (a host stream, a remote buffer, an object of the library that keeps tensors in a
way this module does not know) is `NotReplayable`: the caller builds it as usual.
"""
from __future__ import annotations

import functools
import hashlib
import types
from contextlib import contextmanager
from dataclasses import fields, is_dataclass

import numpy as np

from .program import (Copy, CrossReplicaCopy, Execute, If, InterIpuCopy, OpProgram, Parallel, Program, Repeat,
                      Sequence, Sync)
from .tensor import Tensor, Variable
from .vertex import ComputeSet, Field, VertexTable


class NotReplayable(Exception):
    """The op's template cannot be copied for other tensors: build the op again."""


def digest(*arrays) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.data)
    return h.digest()


def tensor_signature(t: Tensor) -> tuple:
    v = t.var
    m = v.mapping
    key = (v.dtype.str, v.shape, v.category, v.always_live, v.constant is not None, m.digest)
    if t.strided:
        view = ("strided", t.offset, t.shape, t.strides)
    else:
        parts = [getattr(t, name) for name in ("_starts", "_lengths")]
        view = ("runs", t.shape, digest(*[p for p in parts if p is not None]), t._distinct, t._blocks is not None)
        if t._blocks is not None:
            view += (digest(*t._blocks),)
    if t._flat is not None:
        view += ("reshaped", tensor_signature(t._flat))
    return key + view


def signature(tensors) -> tuple:
    """The structure of an op's input views (see the module doc)."""
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors):
        if t is None:
            out.append(None)
            continue
        out.append((tensor_signature(t), first.setdefault(id(t.var), i)))
    return tuple(out)


@contextmanager
def record(graph):
    """Notes the variables and compute sets `graph` makes in the block (a list of both, in order)."""
    made: list = []
    previous = graph._recording
    graph._recording = made
    try:
        yield made
    finally:
        graph._recording = previous
        if previous is not None:
            previous.extend(made)


class Template:
    """What one op call built: its new variables (as they were when it returned), compute sets,
    program nodes and outputs, and its input views."""

    def __init__(self, graph, inputs: list, made: list, programs: list[Program], outputs: list):
        if any(m is None for m in made):
            raise NotReplayable("the op made a host stream or a remote buffer")
        self.ipu = graph.ipu
        self.inputs = [t.var for t in inputs if t is not None]
        self.variables = [(v, v.name, v.dtype, v.shape, v.always_live, v.category, v.constant, v.mapping)
                          for v in made if isinstance(v, Variable)]
        self.compute_sets = [(cs, cs.name, cs.tables) for cs in made if isinstance(cs, ComputeSet)]
        self.programs = programs
        self.outputs = outputs
        self.name = ""
        # a dry run: everything the template holds must be copyable (raises NotReplayable)
        dry = _Copier(graph, {v: v for v in self.inputs}, {v[0]: v[0] for v in self.variables},
                      {cs: cs for cs, _, _ in self.compute_sets}, self.ipu, self.ipu, check=True)
        dry.programs(programs)
        for o in outputs:
            dry.value(o)
        self.foreign = dry.foreign    # variables it uses that it neither made nor took (its own IPU's)

    def replay(self, graph, inputs: list, name: str, template_name: str) -> tuple[list[Program], list]:
        """New variables, compute sets and programs for `inputs` (views of the same structure as
        the template's), named with `name` where the template's names began with
        `template_name`; returns (programs, outputs)."""
        def rename(old: str) -> str:
            return name + old[len(template_name):] if old.startswith(template_name) else old

        if self.foreign and graph.ipu != self.ipu:
            raise NotReplayable(f"the op uses tensors of IPU {self.ipu} it was not given")

        var_map = {old: new.var for old, new in zip(self.inputs, [t for t in inputs if t is not None])}
        for v, vname, dtype, shape, always_live, category, constant, mapping in self.variables:
            new = Variable(graph._unique(rename(vname)), dtype, shape, graph.ipu, always_live, category, constant)
            new._mapping = mapping
            graph.variables.append(new)
            if graph._recording is not None:
                graph._recording.append(new)
            var_map[v] = new
        copier = _Copier(graph, var_map, {}, {}, self.ipu, graph.ipu)
        for cs, csname, tables in self.compute_sets:
            new = ComputeSet(graph._unique(rename(csname)), graph.ipu)
            for table in tables:
                new._parts[table.type] = [VertexTable(table.type, table.tiles, table.params,
                                                      {f: copier.field(c) for f, c in table.fields.items()})]
            graph.compute_sets.append(new)
            if graph._recording is not None:
                graph._recording.append(new)
            copier.cs_map[cs] = new
        copier.rename = rename
        return copier.programs(self.programs), [copier.value(o) for o in self.outputs]


class _Copier:
    """Copies program nodes, tensors and closures with variables and compute sets replaced."""

    def __init__(self, graph, var_map: dict, made: dict, cs_map: dict, from_ipu: int, to_ipu: int,
                 check: bool = False):
        self.graph = graph
        self.var_map = var_map
        self.made = made              # check mode: the template's own variables (mapped to themselves)
        self.cs_map = cs_map
        self.from_ipu, self.to_ipu = from_ipu, to_ipu
        self.check = check
        self.rename = lambda name: name
        self._memo: dict[int, object] = {}
        self._keep = []               # the objects whose ids are memo keys
        self.foreign: set = set()

    # ---- device objects --------------------------------------------------------------------
    def variable(self, v: Variable) -> Variable:
        new = self.var_map.get(v)
        if new is None:
            new = self.made.get(v)
        if new is None:  # a variable the op did not make nor take: only on its own IPU
            if v.ipu != self.to_ipu:
                raise NotReplayable(f"the op uses tensor {v.name!r} of IPU {v.ipu}, neither made nor given")
            self.foreign.add(v)
            return v
        return new

    def tensor(self, t: Tensor) -> Tensor:
        found = self._memo.get(id(t))
        if found is not None:
            return found
        new = Tensor.__new__(Tensor)
        for slot in Tensor.__slots__:
            if hasattr(t, slot):
                object.__setattr__(new, slot, getattr(t, slot))
        new.var = self.variable(t.var)
        if t._flat is not None:
            new._flat = self.tensor(t._flat)
        return self._remember(t, new)

    def field(self, f: Field) -> Field:
        return Field(tuple(self.variable(v) for v in f.variables), f.var, f.offsets, f.starts, f.lengths)

    def compute_set(self, cs: ComputeSet) -> ComputeSet:
        new = self.cs_map.get(cs)
        if new is None:
            if self.check:
                raise NotReplayable(f"the op runs compute set {cs.name!r}, which it did not make")
            return cs
        return new

    def _remember(self, old, new):
        self._memo[id(old)] = new
        self._keep.append(old)
        return new

    # ---- programs --------------------------------------------------------------------------
    def programs(self, programs: list[Program]) -> list[Program]:
        return [self.program(p) for p in programs]

    def program(self, p: Program) -> Program:
        found = self._memo.get(id(p))
        if found is not None:
            return found
        if isinstance(p, Sequence):
            new = Sequence(*self.programs(p.programs), name=self.rename(p.name))
        elif isinstance(p, Parallel):
            new = Parallel(*self.programs(p.programs), name=self.rename(p.name))
        elif isinstance(p, Execute):
            new = Execute(self.compute_set(p.compute_set))
        elif isinstance(p, Copy):
            new = Copy(self.tensor(p.src), self.tensor(p.dst))
        elif isinstance(p, CrossReplicaCopy):
            new = CrossReplicaCopy(self.tensor(p.src), self.tensor(p.dst), p.gw_link)
        elif isinstance(p, Repeat):
            new = Repeat(p.count, self.program(p.body))
        elif isinstance(p, If):
            new = If(self.tensor(p.predicate), self.program(p.then), self.program(p.else_))
        elif isinstance(p, Sync):
            if p.global_:
                raise NotReplayable("the op syncs every IPU")
            new = Sync(self.to_ipu, False)
        elif isinstance(p, OpProgram):
            new = OpProgram(self.rename(p.name), self.program(p.body), self.value(p.fast),
                            tuple(self.value(t) for t in p.reads), tuple(self.value(t) for t in p.writes))
        else:  # InterIpuCopy, streams, remote buffers: another IPU or the host
            raise NotReplayable(f"the op's program holds a {type(p).__name__}")
        if not self.check:
            new.twin = (p, self.from_ipu, self.to_ipu)
        return self._remember(p, new)

    # ---- closures and the values they hold -------------------------------------------------
    def value(self, x):
        if x is None or isinstance(x, (bool, int, float, str, bytes, np.ndarray, np.generic, np.dtype, type)):
            return x
        if isinstance(x, Tensor):
            return self.tensor(x)
        if isinstance(x, Variable):
            return self.variable(x)
        if isinstance(x, ComputeSet):
            return self.compute_set(x)
        if isinstance(x, Program):
            return self.program(x)
        if type(x).__name__ == "Graph" and type(x).__module__.endswith("device.graph"):
            if x.ipu != self.from_ipu:
                raise NotReplayable("the op holds the graph of another IPU")
            return self.graph
        found = self._memo.get(id(x))
        if found is not None:
            return found
        if isinstance(x, (tuple, list)):
            items = [self.value(i) for i in x]
            new = x if all(a is b for a, b in zip(items, x)) else type(x)(items)
        elif isinstance(x, dict):
            items = {k: self.value(v) for k, v in x.items()}
            new = x if all(items[k] is v for k, v in x.items()) else items
        elif isinstance(x, types.FunctionType):
            new = self._function(x)
        elif isinstance(x, functools.partial):
            func, args = self.value(x.func), self.value(x.args)
            kw = self.value(x.keywords)
            new = x if func is x.func and args is x.args and kw is x.keywords else functools.partial(func, *args, **kw)
        elif isinstance(x, types.MethodType):
            owner = self.value(x.__self__)
            new = x if owner is x.__self__ else types.MethodType(x.__func__, owner)
        elif type(x).__module__.split(".")[0] == "ipusim":
            new = self._object(x)
        else:  # numba dispatchers, numpy and Python objects: nothing of the device in them
            new = x
        return self._remember(x, new)

    def _function(self, fn: types.FunctionType):
        if not fn.__closure__:
            return fn
        cells = []
        changed = False
        for cell in fn.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell (a name bound later)
                cells.append(cell)
                continue
            new = self.value(content)
            changed |= new is not content
            cells.append(types.CellType(new) if new is not content else cell)
        if not changed:
            return fn
        out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
        out.__kwdefaults__ = fn.__kwdefaults__
        return out

    def _object(self, x):
        """An object of the library (a plan, a table): the same object when nothing in it refers to
        the device, else a shallow copy with its attributes copied."""
        if is_dataclass(x):
            names = [f.name for f in fields(x)]
        elif hasattr(x, "__dict__"):
            names = list(vars(x))
        else:
            raise NotReplayable(f"the op holds a {type(x).__name__}, which cannot be copied")
        values = {n: getattr(x, n) for n in names}
        new_values = {n: self.value(v) for n, v in values.items()}
        if all(new_values[n] is v for n, v in values.items()):
            return x
        import copy
        out = copy.copy(x)
        for n, v in new_values.items():
            object.__setattr__(out, n, v)
        return out
