"""Blocks: the user's annotations that split a model into parts placed on IPUs.

A *block* is a named region of the model's forward pass. Execution strategies
(``poptorch_lite.api.strategies``) later group blocks into stages and place them on
IPUs. Blocks are declared four ways, as in PopTorch:

- ``with Block("B1", ipu_id=0): ...`` -- the ops inside the ``with`` belong to "B1";
- ``Block.start("B1", ipu_id=0)`` -- "B1" lasts until the next block starts;
- ``BeginBlock(module, "B1", ipu_id=0)`` -- "B1" starts each time ``module`` is called
  and lasts until the next block starts;
- ``@BlockFunction("B1", ipu_id=0)`` -- each call of the function runs inside "B1".

Blocks only act while a model is being captured (``poptorch_lite.compiler.export``), through
the thread-local state opened by :func:`tracing_blocks`. Outside it they do nothing,
so an annotated model runs in eager PyTorch exactly as before.

Rules during a capture (the same as PopTorch's):

- ops issued before the first block starts belong to the *default region*, which
  PopTorch places in stage 0 on IPU 0;
- leaving a ``with Block`` (or a ``BlockFunction`` call) leaves no block active:
  blocks do not nest and the enclosing block is not restored. From then on an op
  issued before another block starts is an error (PopTorch: "No active Block");
- a block without a ``user_id`` gets an automatic id, "0", "1", ... in the order the
  unnamed blocks start. Every capture starts counting at "0"; ``Block.useAutoId()``
  restarts the count (PopTorch needs it because it traces the model several times).
  A ``BeginBlock`` without ``user_id`` keeps the id it got on its first call for the
  rest of the capture, so a module called twice starts the same block twice;
- a ``user_id`` is a string or an integer (PopTorch's older code numbers its blocks); ids
  are compared as given, so ``Stage(1)`` names the block of ``user_id=1``, not ``"1"``;
- blocks with the same ``user_id`` are one block. Each start records its own
  ``ipu_id``: a block started on two IPUs has ops on both (phased execution uses
  this to spread one stage over several IPUs).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import torch

from .errors import Error


BlockId = Union[str, int]  # a block's user_id


class BlockError(Error, RuntimeError):
    """A block annotation is invalid or an op was issued outside any block."""


@dataclass(frozen=True)
class BlockRef:
    """The block an op was issued in: its id and the ``ipu_id`` it was started with.

    ``user_id`` is None only for the default region (ops before the first block).
    """

    user_id: Optional[BlockId]
    ipu_id: Optional[int] = None

    @property
    def is_default(self) -> bool:
        return self.user_id is None

    def __str__(self) -> str:
        if self.is_default:
            return "(before first block)"
        if self.ipu_id is None:
            return repr(self.user_id)
        return f"{self.user_id!r} (ipu_id={self.ipu_id})"


DEFAULT_REGION = BlockRef(None, None)


def _check_ids(user_id, ipu_id) -> None:
    if user_id is not None and (isinstance(user_id, bool) or not isinstance(user_id, (str, int)) or user_id == ""):
        raise BlockError(
            f"a block's user_id must be a non-empty string, an integer or None, got {user_id!r}; "
            "for example Block(\"Encoder\")"
        )
    if ipu_id is not None and (
        isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0
    ):
        raise BlockError(
            f"a block's ipu_id must be a non-negative integer or None, got {ipu_id!r}"
        )


@dataclass
class BlockTrace:
    """Block state of one capture: which block is active and how auto ids count."""

    active: Optional[BlockRef] = DEFAULT_REGION
    last_closed: Optional[BlockRef] = None
    next_auto_id: int = 0
    scopes: list = field(default_factory=list)       # the open NameScopes, outermost first
    _begin_block_ids: dict = field(default_factory=dict)
    _tensor_ids: dict = field(default_factory=dict)  # id(tensor) -> (number, tensor kept alive)

    def tensor_id(self, tensor) -> int:
        """A number for each distinct tensor the capture's code holds (getIpuTensorId)."""
        entry = self._tensor_ids.get(id(tensor))
        if entry is None or entry[1] is not tensor:
            entry = self._tensor_ids[id(tensor)] = (len(self._tensor_ids) + 1, tensor)
        return entry[0]

    @property
    def scope(self) -> str:
        """The open name scopes as a path, "encoder/attention" ("" when none)."""
        return "/".join(self.scopes)

    def start(self, user_id: Optional[BlockId], ipu_id: Optional[int], key=None) -> BlockRef:
        """Make a block active; ``key`` identifies a BeginBlock whose auto id persists."""
        if user_id is None and key is not None:
            user_id = self._begin_block_ids.get(key)
            if user_id is None:
                user_id = self._begin_block_ids[key] = self._auto_id()
        elif user_id is None:
            user_id = self._auto_id()
        self.active = BlockRef(user_id, ipu_id)
        return self.active

    def end(self) -> None:
        """Leave the active block: no block is active until the next one starts."""
        if self.active is not None and not self.active.is_default:
            self.last_closed = self.active
        self.active = None

    def reset_auto_id(self) -> None:
        self.next_auto_id = 0

    def _auto_id(self) -> str:
        block_id = str(self.next_auto_id)
        self.next_auto_id += 1
        return block_id


_local = threading.local()


def active_trace() -> Optional[BlockTrace]:
    """The block state of the capture running in this thread, or None."""
    return getattr(_local, "trace", None)


@contextmanager
def tracing_blocks() -> Iterator[BlockTrace]:
    """Activate block annotations in this thread for the duration of a capture."""
    previous = active_trace()
    trace = BlockTrace()
    _local.trace = trace
    try:
        yield trace
    finally:
        _local.trace = previous


class Block:
    """A block of the model: a context manager, or ``Block.start(...)`` without an end.

    >>> with Block("Encoder", ipu_id=0):
    ...     x = self.encoder(x)

    :param user_id: the block's name; blocks with the same name are one block, and
        strategies refer to blocks by name. None gives an automatic id ("0", "1", ...).
    :param ipu_id: the IPU to run on, unless the block's Stage sets one.
    """

    def __init__(self, user_id: Optional[BlockId] = None, ipu_id: Optional[int] = None):
        _check_ids(user_id, ipu_id)
        self.user_id = user_id
        self.ipu_id = ipu_id

    @staticmethod
    def useAutoId() -> None:
        """Restart the automatic ids of unnamed blocks at "0"."""
        trace = active_trace()
        if trace is not None:
            trace.reset_auto_id()

    @staticmethod
    def start(user_id: Optional[BlockId] = None, ipu_id: Optional[int] = None) -> None:
        """Start a block that lasts until the next block starts."""
        _check_ids(user_id, ipu_id)
        trace = active_trace()
        if trace is not None:
            trace.start(user_id, ipu_id)

    def __enter__(self) -> "Block":
        trace = active_trace()
        if trace is not None:
            trace.start(self.user_id, self.ipu_id)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        trace = active_trace()
        if trace is not None:
            trace.end()

    def __repr__(self) -> str:
        return f"Block(user_id={self.user_id!r}, ipu_id={self.ipu_id!r})"


class BeginBlockHook:
    """The forward-pre-hook ``BeginBlock`` puts on a module; also its annotation."""

    def __init__(self, user_id: Optional[BlockId], ipu_id: Optional[int]):
        self.user_id = user_id
        self.ipu_id = ipu_id

    def start(self) -> None:
        """Start this module's block in the active capture, if any."""
        trace = active_trace()
        if trace is not None:
            trace.start(self.user_id, self.ipu_id, key=id(self))

    def __call__(self, module, args) -> None:
        self.start()

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self.user_id!r}, ipu_id={self.ipu_id!r})"


def block_annotation(module: torch.nn.Module) -> Optional[BeginBlockHook]:
    """The BeginBlock annotation of ``module`` itself (not its submodules), or None."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, BeginBlockHook):
            return hook
    return None


def module_repr(module: torch.nn.Module) -> str:
    """``repr(module)`` showing the BeginBlock annotation of every (sub)module before its name."""
    extra = module.extra_repr()
    lines = extra.split("\n") if extra else []
    children = [f"({name}): " + module_repr(child).replace("\n", "\n  ") for name, child in module.named_children()]
    annotation = block_annotation(module)
    text = (f"{annotation!r} " if annotation is not None else "") + module._get_name() + "("
    if len(lines) == 1 and not children:
        text += lines[0]
    elif lines or children:
        text += "\n  " + "\n  ".join(lines + children) + "\n"
    return text + ")"


def BeginBlock(
    module: torch.nn.Module, user_id: Optional[BlockId] = None, ipu_id: Optional[int] = None
) -> torch.nn.Module:
    """Start a block each time ``module`` is called; it lasts until the next block starts.

    Works for any module, including leaf layers such as ``nn.Linear``. Returns the
    module itself (annotated in place). A function (not a module) is wrapped in a
    ``LegacyBeginBlockFn``, which is returned: call that instead.
    """
    if not isinstance(module, torch.nn.Module):
        if callable(module):  # PopTorch's older form: a function, wrapped in a module that starts the block
            return LegacyBeginBlockFn(module, user_id, ipu_id)
        raise BlockError(
            f"BeginBlock expects a torch.nn.Module or a function, got {type(module).__name__}"
        )
    _check_ids(user_id, ipu_id)
    existing = block_annotation(module)
    if existing is not None:
        raise BlockError(
            f"module has already been assigned to a block: this {type(module).__name__} begins {existing!r}; "
            "call poptorch.removeBlocks(module) before assigning it to another block"
        )
    module.register_forward_pre_hook(BeginBlockHook(user_id, ipu_id))
    return module


def removeBlocks(module: torch.nn.Module) -> None:
    """Remove the BeginBlock annotations of ``module`` and all its submodules."""
    if not isinstance(module, torch.nn.Module):
        raise BlockError(f"removeBlocks expects a torch.nn.Module, got {type(module).__name__}")
    for submodule in module.modules():
        hooks = submodule._forward_pre_hooks
        for handle_id in [k for k, hook in hooks.items() if isinstance(hook, BeginBlockHook)]:
            del hooks[handle_id]


def getIpuTensorId(tensor: torch.Tensor) -> int:  # pylint: disable=invalid-name
    """The id of a tensor on the IPU: while a model is being captured, a number for each distinct
    tensor its code holds (the same tensor, the same id). Outside a capture no tensor is on the IPU."""
    trace = active_trace()
    if trace is None or not isinstance(tensor, torch.Tensor):
        raise BlockError("You may only call getIpuTensorId on an IPU tensor: a tensor inside a model's forward "
                         "while the model compiles")
    return trace.tensor_id(tensor)


class NameScope:
    """Prefix the names of the ops made inside it: ``with NameScope("attention"): ...``.

    Scopes nest ("encoder/attention"); the op names carry them (``<stage>/<scope>/<op>``), so
    the compute sets of the profile and trace.json, and op_placement, show them. Like blocks,
    name scopes act only while a model is being captured."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name or "/" in name:
            raise BlockError(f"NameScope expects a non-empty name without '/', got {name!r}")
        self.name = name

    def __enter__(self) -> "NameScope":
        trace = active_trace()
        if trace is not None:
            trace.scopes.append(self.name)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        trace = active_trace()
        if trace is not None and trace.scopes and trace.scopes[-1] == self.name:
            trace.scopes.pop()

    def __repr__(self) -> str:
        return f"NameScope({self.name!r})"


class LegacyBeginBlockFn(torch.nn.Module):
    """``BeginBlock`` given a function instead of a module (PopTorch's older form): calling it
    starts the block, then calls the function."""

    def __init__(self, layer_to_call: Callable, user_id: Optional[BlockId] = None, ipu_id: Optional[int] = None):
        super().__init__()
        if not callable(layer_to_call):
            raise BlockError(f"LegacyBeginBlockFn expects a callable, got {type(layer_to_call).__name__}")
        _check_ids(user_id, ipu_id)
        self._layer_to_call = layer_to_call
        self._hook = BeginBlockHook(user_id, ipu_id)

    @property
    def _user_id(self):
        return self._hook.user_id

    @property
    def _ipu_id(self):
        return self._hook.ipu_id

    def forward(self, *args, **kwargs):
        self._hook.start()
        return self._layer_to_call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LegacyBeginBlockFn({self._layer_to_call!r}, {self._hook!r})"


def BlockFunction(
    user_id: Optional[BlockId] = None, ipu_id: Optional[int] = None
) -> Callable[[Callable], Callable]:
    """Decorator: each call of the function runs inside ``Block(user_id, ipu_id)``."""
    _check_ids(user_id, ipu_id)

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)

        return wrapper

    return decorator
