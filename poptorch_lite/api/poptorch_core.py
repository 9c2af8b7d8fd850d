"""``poptorch.poptorch_core``: what PopTorch's native module gives Python, on emulated IPUs.

PopTorch's C++ core is a compiled module; its own tests (and some programs) import it for:

- ``Error``, ``RecoverableError``, ``UnrecoverableError``: the error classes (here the API's,
  ``poptorch_lite.api.errors``, which every error of this project derives from);
- ``_validateOptions(options.toDict())``: parse an options dictionary as the compiler does
  before it compiles, raising ``Error`` for an unknown option, a value of the wrong type or an
  enum value out of range, and logging (at debug level) every option it sets;
- ``TestErrorType`` and ``_throwTestError(kind)``: raise the error each layer of the stack
  reports (PopTorch, PopART, PopLibs, Poplar's recoverable, unrecoverable and link errors), with
  the fields the error handling fills in (type, message, location, recovery action);
- ``isCompilingWithDispatcher()``: whether a model's forward is being captured right now
  (PopTorch's dispatcher records it; here PyTorch 2's capture, ``poptorch_lite.compiler.export``),
  so a test can check that a failed compile left no capture open;
- ``propagateInputShapes(graph)``: shape propagation over a TorchScript graph whose inputs
  have types (``Value.inferTypeFrom``).
"""
from __future__ import annotations

import enum
import functools
import logging
from typing import Any

import torch

from . import enums, errors, popart
from .blocks import active_trace
from .errors import Error, RecoverableError, UnrecoverableError

logger = logging.getLogger("poptorch_lite")

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType", "isCompilingWithDispatcher",
           "propagateInputShapes"]


# ---- errors ----------------------------------------------------------------------------------

class TestErrorType(enum.IntEnum):
    """The kinds of error ``_throwTestError`` raises: one per layer of the stack."""
    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


# (class, type, message, recovery action) of each kind, as PopTorch's error handling reports them
_TEST_ERRORS = {
    TestErrorType.Poptorch: (Error, "poptorch_cpp_error", "This is a PopTorch error", ""),
    TestErrorType.Popart: (Error, "popart_exception", "This is a Popart error", ""),
    TestErrorType.PopartInternal: (Error, "popart_internal_exception", "This is a Popart error", ""),
    TestErrorType.Poplibs: (Error, "poplibs_exception", "This is a Poplibs error", ""),
    TestErrorType.PoplarUnrecoverable: (UnrecoverableError, "poplar_unrecoverable_runtime_error",
                                        "This is not recoverable", ""),
    TestErrorType.PoplarUnknown: (Error, "poplar_unknown_runtime_error", "Don't know what happened", ""),
    TestErrorType.PoplarRecoverableFullReset: (RecoverableError, "poplar_recoverable_runtime_error",
                                               "Reboot needed", "FULL_RESET"),
    TestErrorType.PoplarLinkError: (Error, "poplar_link_error",
                                    "Link error. Output: Library -lfoo not found\ncheck path", ""),
}


def _throwTestError(kind: TestErrorType) -> None:  # pylint: disable=invalid-name
    """Raise the error of `kind` from inside two nested contexts, ``throwTestError::topLevel`` and
    ``throwTestError::bottomLevel``: its `location` lists both, its `message` neither."""
    try:
        cls, type_, message, action = _TEST_ERRORS[TestErrorType(kind)]
    except (ValueError, KeyError):
        raise errors.make(f"Unknown TestErrorType {kind!r}: use a poptorch_core.TestErrorType") from None
    with errors.context("throwTestError::topLevel"), errors.context("throwTestError::bottomLevel"):
        raise errors.make(message, cls=cls, type=type_, recovery_action=action)


# ---- the capture -----------------------------------------------------------------------------

def isCompilingWithDispatcher() -> bool:  # pylint: disable=invalid-name
    """True while a model's forward is being captured in this thread."""
    return active_trace() is not None


def propagateInputShapes(graph: torch._C.Graph) -> None:  # pylint: disable=invalid-name
    """Give every value of a TorchScript `graph` the shape its inputs' types imply (set them first
    with ``graph_input.inferTypeFrom(example)``); PyTorch's symbolic shape analysis."""
    if not isinstance(graph, torch._C.Graph):
        raise errors.make(f"propagateInputShapes expects a torch._C.Graph (a TorchScript graph), got "
                          f"{type(graph).__name__}")
    torch._C._jit_pass_propagate_shapes_on_graph(graph)


# ---- options ---------------------------------------------------------------------------------

def _reference() -> dict:
    """The keys and default value types of ``Options().toDict()``, made once."""
    global _REFERENCE  # pylint: disable=global-statement
    if _REFERENCE is None:
        from .options import Options  # pylint: disable=import-outside-toplevel
        _REFERENCE = Options().toDict()
    return _REFERENCE


_REFERENCE = None


def _text(value) -> str:
    """A value as PopTorch's C++ logging prints it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(int(value.value)) if isinstance(value.value, int) else str(value.value)
    return str(value)


def _log_set(name: str, value) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            logger.debug("poptorch.Options set %s[%s] to %s", name, key, _text(item))
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            logger.debug("poptorch.Options added %s to %s", _text(item), name)
    elif value is not None:
        logger.debug("poptorch.Options set %s to value %s", name, _text(value))


def _enum_class(text: str):
    """The enum named by ``"OutputMode.All"`` (as toDict writes enum values), else None."""
    head, dot, _ = text.partition(".")
    enum_class = getattr(enums, head, None)
    if dot and isinstance(enum_class, type) and issubclass(enum_class, enum.Enum):
        return enum_class
    return None


def _check_value(path: str, value: Any, reference: Any) -> Any:
    """`value` of option `path` has the type of its default `reference` (None: any type); the
    value, an enum member for an enum's text."""
    if reference is None or value is None:
        return value
    if isinstance(reference, bool) or isinstance(value, bool):
        ok = isinstance(reference, bool) and isinstance(value, bool)
    elif isinstance(reference, int):
        ok = isinstance(value, int) and value >= 0
    elif isinstance(reference, float):
        ok = isinstance(value, (int, float))
    elif isinstance(reference, str) and _enum_class(reference) is not None:
        enum_class = _enum_class(reference)
        head, _, member = value.partition(".") if isinstance(value, str) else ("", "", "")
        if head != enum_class.__name__ or member not in enum_class.__members__:
            members = ", ".join(f"{enum_class.__name__}.{m}" for m in enum_class.__members__)
            raise errors.make(f"Value {value!r} for option {path} out of range: use one of {members}")
        return enum_class[member]
    else:
        ok = isinstance(value, type(reference))
    if not ok:
        raise errors.make(f"Unknown value type {type(value).__name__} for option {path}: it takes a "
                          f"{type(reference).__name__} (its default is {reference!r})")
    return value


def _check_group(prefix: str, values: dict, reference: dict) -> None:
    for name, value in values.items():
        path = f"{prefix}{name}"
        if name == "_Popart" and not prefix:
            _check_popart(value)
            continue
        if name == "Emulator" and not prefix:
            _check_emulator(value, reference[name])
            continue
        with errors.context(f"option: {path}"):
            if name not in reference:
                kind = popart.value_kind(value) or type(value).__name__
                raise errors.make(f"Unknown {kind} option {path}.{popart._hint(name, reference)}")
            if isinstance(reference[name], dict) and name[:1].isupper():   # an option group
                if not isinstance(value, dict):
                    raise errors.make(f"Option group {path} must be a dict, got {value!r}")
                _check_group(f"{path}.", value, reference[name])
                continue
            _log_set(name, _check_value(path, value, reference[name]))


def _check_popart(values: dict) -> None:
    if not isinstance(values, dict):
        raise errors.make(f"The PopART options (_Popart) must be a dict, got {values!r}")
    if "patterns" in values and "patterns_level" not in values:
        raise errors.make("PopART option 'patterns' should not be set without first setting 'patterns_level'.")
    for name, value in values.items():
        with errors.context(f"option: {name}"):
            popart.check_option(name, value)
            _log_set(name, value)


def _check_emulator(values: dict, reference: dict) -> None:
    """The emulator's own options (``Options.Emulator``), each checked by its setter: their values
    may be of more than one type (a host-thread count or 'auto', a target name or an ipusim.Target)."""
    from .options import Options  # pylint: disable=import-outside-toplevel
    if not isinstance(values, dict):
        raise errors.make(f"Option group Emulator must be a dict, got {values!r}")
    group = Options().Emulator
    setters = {"target": group.setTarget, "mode": group.setMode, "host_threads": group.setHostThreads,
               "pipeline_schedule": group.setPipelineSchedule}
    for name, value in values.items():
        path = f"Emulator.{name}"
        with errors.context(f"option: {path}"):
            if name not in reference:
                raise errors.make(f"Unknown option {path}.{popart._hint(name, reference)}")
            # the target may be the default (None) or a built ipusim.Target, which toDict writes as its repr
            built_target = name == "target" and (value is None or str(value).startswith("Target("))
            try:
                if not built_target:
                    setters[name](value)
            except (TypeError, ValueError) as error:
                raise errors.make(f"Value {value!r} for option {path} out of range: {error}") from None
            _log_set(name, value)


def _validateOptions(options: dict) -> None:  # pylint: disable=invalid-name
    """Parse `options` (``Options.toDict()``) as the compiler does: every option must be one
    ``Options`` has (``_Popart``: one PopTorch passes to PopART) with a value of its type. Logs
    each option set at debug level; raises ``poptorch.Error`` naming the first one wrong."""
    if not isinstance(options, dict):
        raise errors.make(f"_validateOptions expects the dict of Options.toDict(), got {type(options).__name__}")
    with errors.context("parseSessionOptions"):
        _check_group("", options, _reference())


def parse_options(options) -> None:
    """What the compiler does first with a model's options (``PoplarExecutor``, when the model is
    made): parse them as ``_validateOptions`` does, and apply the process-wide setting they carry,
    the limit on repeated log lines (``Options.maxRepeatLogs``), counting repeats afresh."""
    from .options import repeat_limit  # pylint: disable=import-outside-toplevel
    _validateOptions(options.toDict())
    repeat_limit.limit = options.max_repeat_logs
    repeat_limit.counts.clear()
    unmodelled = tuple(popart_without_effect(options))
    if unmodelled and unmodelled not in _LISTED:
        _LISTED.add(unmodelled)
        logger.warning("PopART options accepted with no effect on the emulator: %s", ", ".join(unmodelled))


_LISTED: set = set()   # the lists of options without effect already logged (each once per process)


def popart_without_effect(options) -> list[str]:
    """The PopART options the user set on `options` that the emulator does not model."""
    from .options import Options  # pylint: disable=import-outside-toplevel
    return popart.without_effect(options._Popart.options, _default_popart(Options))


@functools.cache
def _default_popart(options_class) -> dict:
    return dict(options_class()._Popart.options)
