"""``Options``: how a model is compiled and run, with PopTorch's API.

Setters chain (they return the object they belong to). Options freeze when a
model or a ``DataLoader`` takes them; ``clone()`` gives an unfrozen copy.
Defaults can come from the environment, as in PopTorch:

- ``POPTORCH_DEFAULT_OPTIONS``: a JSON object mapping setter names to
  arguments, applied by every ``Options()``; for example
  ``{"deviceIterations": 4, "Training.gradientAccumulation": 8,
  "outputMode": ["OutputMode.EveryN", 2], "_Popart.set": ["key", 1]}``.
  A list gives several positional arguments; a string ``"Enum.Member"``
  names an enum member.
- ``POPTORCH_CACHE_DIR``: turns executable caching on with that directory.
- ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``: default process id and
  number of processes (set by ``mpirun`` and ``poprun``).
- ``POPTORCH_LOG_LEVEL``: ``TRACE``, ``DEBUG``, ``INFO``, ``WARN``, ``ERR`` or
  ``OFF`` for the ``poptorch_lite`` logger (see ``setLogLevel``).
"""
import ast
import copy
import difflib
import enum
import json
import logging
import numbers
import os
import sys
from types import MappingProxyType
from typing import Any, Dict, Optional

import torch

from . import enums, popart, strategies
from .enums import (CommGroupType, ConnectionType, HalfFloatCastingBehavior,
                    MeanReductionStrategy, OutputMode, ReductionType,
                    SyncPattern)
from .errors import UnsupportedAttributeError

logger = logging.getLogger("poptorch_lite")

TRACE = 5
_LOG_LEVELS = {
    "TRACE": TRACE,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "OFF": logging.CRITICAL + 10,
}
# PopTorch's numbers for the same levels (its C++ logging enum), in this order: 0 TRACE .. 6 OFF.
_LOG_NUMBERS = dict(enumerate(_LOG_LEVELS))


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a record is logged (a
    handler made before stdout was redirected, by pytest's capture or
    ``contextlib.redirect_stdout``, keeps writing to the redirection)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def setLogLevel(level) -> None:
    """Set how much ``poptorch_lite`` logs: ``TRACE``, ``DEBUG``, ``INFO``,
    ``WARN``, ``ERR``, ``OFF`` (and ``CRITICAL``), or PopTorch's numbers for
    them: 0 TRACE, 1 DEBUG, 2 INFO, 3 WARN, 4 ERR, 6 OFF."""
    if isinstance(level, str):
        key = level.strip().upper()
        if key not in _LOG_LEVELS:
            raise ValueError(f"Unknown log level: {level}. Valid values are "
                             "DEBUG, ERR, INFO, OFF, TRACE and WARN (TRACE, "
                             "DEBUG, INFO, WARN, ERR, CRITICAL, OFF, from the "
                             "most to the least).")
    elif isinstance(level, numbers.Integral) and not isinstance(level, bool):
        key = _LOG_NUMBERS.get(int(level))
        if key is None or key == "CRITICAL":    # PopTorch has no level 5
            numbered = ", ".join(f"{i} ({name})" for i, name in _LOG_NUMBERS.items() if name != "CRITICAL")
            raise ValueError(f"Invalid log level integer {level!r}: use {numbered}, "
                             "or the level's name.")
    else:
        raise TypeError(f"setLogLevel expects a level name or number, got "
                        f"{level!r}.")
    number = _LOG_LEVELS[key]
    logging.addLevelName(TRACE, "TRACE")
    logger.setLevel(number)
    if not logger.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(_LogFormatter("[%(asctime)s] [poptorch_lite] [%(levelname)s] %(message)s"))
        logger.addHandler(handler)


class _LogFormatter(logging.Formatter):
    """PopTorch's log line: the level in lower case (`[debug]`, `[warning]`)."""

    def format(self, record):
        record = logging.makeLogRecord(record.__dict__)   # a copy: other handlers keep the level's name
        record.levelname = record.levelname.lower()
        return super().format(record)


if os.environ.get("POPTORCH_LOG_LEVEL"):
    try:
        setLogLevel(os.environ["POPTORCH_LOG_LEVEL"])
    except ValueError as error:
        raise ValueError(f"POPTORCH_LOG_LEVEL: {error}") from None


class FrozenOptionsError(AttributeError):
    """Raised by a setter of options that a model or DataLoader already uses."""


class ConfigFileError(ValueError):
    """Raised by ``Options.loadFromFile`` for a line it cannot apply."""


_FROZEN_MESSAGE = (
    "Can't modify frozen Options: they were given to a model or a DataLoader, "
    "which keeps using them, so they can no longer change. Call "
    "options.clone() to get an unfrozen copy and change that instead.")


# --- argument checks: every message names the option and the fix ----------


def _int_arg(option: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{option} expects an int >= {minimum}, got "
                        f"{value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{option} must be >= {minimum}, got {value}.")
    return int(value)


AUTO_THREADS = "auto"


def _host_threads(option: str, value) -> int | str:
    """A host-thread count: an int >= 1 (also as a string of digits, from the environment) or "auto"."""
    if value == AUTO_THREADS:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    try:
        return _int_arg(option, value)
    except (TypeError, ValueError):
        raise ValueError(f"{option} expects an int >= 1 or 'auto', got {value!r}.") from None


def _bool_arg(option: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{option} expects True or False, got {value!r}.")
    return value


def _enum_arg(option: str, value, enum_class, excluded=()):
    allowed = [m for m in enum_class if m not in excluded]
    if not isinstance(value, enum_class) or value in excluded:
        names = ", ".join(f"{enum_class.__name__}.{m.name}" for m in allowed)
        raise TypeError(f"{option} expects one of {names}; got {value!r}.")
    return value


def _path_arg(option: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{option} expects a non-empty path (str or "
                        f"os.PathLike), got {value!r}.")
    return os.fspath(value)


def _excludes(option: str, excludes) -> list:
    if isinstance(excludes, str) or not all(
            isinstance(e, str) and e for e in excludes):
        raise TypeError(f"{option} expects path fragments (non-empty str), "
                        f"got {excludes!r}.")
    return list(excludes)


# Frames in these directories are library code, not the user's source line.
DEFAULT_SOURCE_LOCATION_EXCLUDES = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)

DEFAULT_REPEAT_LOGS = 4
REPEATED = {"repeated": True}  # ``extra=`` of a log call whose line may repeat


class _RepeatLimit(logging.Filter):
    """Shows each repeating log call site (records logged with
    ``extra=REPEATED``) ``limit`` times, then once "...repeated messages
    suppressed...", then not at all (``Options.maxRepeatLogs``)."""

    def __init__(self, limit: Optional[int]):
        super().__init__()
        self.limit = limit
        self.counts: Dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if self.limit is None or not getattr(record, "repeated", False):
            return True
        site = (record.pathname, record.lineno)
        count = self.counts.get(site, 0)
        self.counts[site] = count + 1
        if count < self.limit:
            return True
        if count == self.limit:
            record.msg, record.args = "...repeated messages suppressed...", ()
            return True
        return False


repeat_limit = _RepeatLimit(DEFAULT_REPEAT_LOGS)
logger.addFilter(repeat_limit)


def _plain(value):
    """Options value -> plain data for ``toDict``."""
    if isinstance(value, _OptionGroup):
        return value.toDict()
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value


class _OptionGroup:
    """A set of option values changed only through setter methods.

    Values live in ``_values``; ``_set`` refuses changes once frozen. Public
    attributes cannot be assigned (use the setters, which validate).
    """

    def __init__(self, **defaults):
        object.__setattr__(self, "_frozen", False)
        object.__setattr__(self, "_values", dict(defaults))

    def __getattr__(self, name):
        """A PopTorch option this emulator does not have is an error naming
        it (and the options of this group that come closest)."""
        if name.startswith("_"):
            raise AttributeError(name)
        public = [n for n in dir(type(self)) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnsupportedAttributeError(
            f"{type(self).__name__.lstrip('_')}.{name} is not supported by "
            f"poptorch_lite (PopTorch's API on emulated IPUs).{hint} "
            f"help(poptorch_lite.Options) lists the options it has.",
            name=name, obj=self)

    def __setattr__(self, name, value):
        if not name.startswith("_"):
            raise AttributeError(
                f"{type(self).__name__}.{name} cannot be assigned: change "
                f"options through their setter methods, for example "
                f"options.deviceIterations(4).")
        object.__setattr__(self, name, value)

    def _check_mutable(self) -> None:
        if self._frozen:
            raise FrozenOptionsError(_FROZEN_MESSAGE)

    def _set(self, **values) -> None:
        self._check_mutable()
        self._values.update(values)

    def _set_frozen(self, frozen: bool) -> None:
        object.__setattr__(self, "_frozen", frozen)
        for value in [*vars(self).values(), *self._values.values()]:
            if isinstance(value, _OptionGroup) and value._frozen != frozen:
                value._set_frozen(frozen)

    def toDict(self) -> Dict[str, Any]:
        """The option values as plain data (enums as ``"Enum.Member"``)."""
        return {key: _plain(value) for key, value in self._values.items()}

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"{type(self).__name__}({body})"


def _value(key: str, doc: str) -> property:
    return property(lambda self: self._values[key], doc=doc)


class _PopartOptions(_OptionGroup):
    """PopART session options (``options._Popart``): recorded as given.

    Keys this emulator understands drive its behaviour (``cachePath``,
    ``engineOptions``, ``syntheticDataMode``, ...); the others are kept so that
    scripts written for PopTorch run unchanged.
    """

    def __init__(self):
        super().__init__(instrumentWithHardwareCycleCounter=False,
                         rearrangeAnchorsOnHost=False)

    @property
    def options(self):
        """Read-only view of every recorded PopART option."""
        return MappingProxyType(self._values)

    def set(self, key: str, value) -> "_PopartOptions":
        """Record the PopART option ``key``."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"_Popart.set expects an option name (a non-empty "
                            f"str) as key, got {key!r}.")
        self._set(**{key: copy.deepcopy(value)})
        return self

    def get(self, key: str, default=None):
        """The value of PopART option ``key`` (``default`` when unset): the one
        place the emulator reads PopART options. ``key`` must be an option
        PopTorch passes to PopART (``popart.SESSION_OPTIONS``)."""
        if key not in popart.SESSION_OPTIONS:
            raise KeyError(f"_Popart.get: {key!r} is not a PopART session "
                           "option (popart.SESSION_OPTIONS lists them).")
        return self._values.get(key, default)

    def checkIsFrozen(self) -> None:
        """Raise ``AttributeError`` if these options are frozen."""
        self._check_mutable()

    def setEngineOptions(self, engine_options: Dict[str, str]
                         ) -> "_PopartOptions":
        """Set Poplar engine options (merged into the ones already set)."""
        if not isinstance(engine_options, dict):
            raise TypeError(f"_Popart.setEngineOptions expects a dict of "
                            f"str to str, got {engine_options!r}.")
        merged = dict(self._values.get("engineOptions", {}))
        merged.update({str(k): str(v) for k, v in engine_options.items()})
        return self.set("engineOptions", merged)

    def setPatterns(self, patterns: Dict[str, bool],
                    level: int = 2) -> "_PopartOptions":
        """Enable or disable PopART graph patterns, starting from ``level``."""
        if not isinstance(patterns, dict) or not all(
                isinstance(k, str) and isinstance(v, bool)
                for k, v in patterns.items()):
            raise TypeError("_Popart.setPatterns expects a dict of pattern "
                            f"name to True/False, got {patterns!r}.")
        for name in patterns:
            popart.check_pattern(name)
        level = _int_arg("_Popart.setPatterns: level", level, minimum=0)
        if level > max(popart.PatternsLevel):
            raise ValueError("_Popart.setPatterns: level must be a "
                             "popart.PatternsLevel (0 NoPatterns, 1 Minimal, "
                             f"2 Default, 3 All), got {level}.")
        self.set("patterns_level", level)
        return self.set("patterns", patterns)

    def _merge(self, key: str, entries: Dict[str, Any]) -> None:
        merged = dict(self._values.get(key, {}))
        merged.update(entries)
        self.set(key, merged)


class _JitOptions(_OptionGroup):
    """Options of the model capture (``options.Jit``)."""

    def __init__(self):
        super().__init__(trace_model=True)

    trace_model = _value("trace_model", "Whether the model is traced.")

    def traceModel(self, trace_model: bool) -> "_JitOptions":
        """PopTorch chooses between ``torch.jit.trace`` and its dispatcher; this emulator always
        captures through PyTorch 2's dispatcher (``make_fx``, as PopTorch's dispatcher path sees
        the ATen ops) and records the flag."""
        self._set(trace_model=_bool_arg("Jit.traceModel", trace_model))
        return self


class _PrecisionOptions(_OptionGroup):
    """Numerical precision options (``options.Precision``)."""

    def __init__(self, popart: _PopartOptions):
        super().__init__(
            half_float_casting=HalfFloatCastingBehavior.Default,
            running_statistics_always_float=True)
        self._popart = popart

    half_float_casting = _value("half_float_casting",
                                "The deprecated casting setting last given (it has no effect).")
    running_statistics_always_float = _value(
        "running_statistics_always_float",
        "Whether batch-norm running statistics stay in float32.")

    @property
    def partials_type(self) -> Optional[torch.dtype]:
        """The dtype of matmul/convolution partials, or None if unset."""
        name = self._popart.get("partialsTypeMatMuls")
        return {"float": torch.float32, "half": torch.float16}.get(name)

    def halfFloatCasting(self, half_float_casting: HalfFloatCastingBehavior
                         ) -> "_PrecisionOptions":
        """Deprecated, as in PopTorch 3: ops mixing float16 and float32 operands always follow
        PyTorch's promotion (``HalfUpcastToFloat``); for float16 compute, cast the float32
        operands to float16 in the model."""
        self._set(half_float_casting=_enum_arg(
            "Precision.halfFloatCasting", half_float_casting,
            HalfFloatCastingBehavior))
        logger.warning("[Deprecated] options.Precision.halfFloatCasting() has no effect: ops mixing float16 and "
                       "float32 operands always upcast to float32 as in PyTorch (HalfUpcastToFloat); cast float32 "
                       "operands to float16 explicitly to compute in float16.")
        return self

    def runningStatisticsAlwaysFloat(self,
                                     value: bool) -> "_PrecisionOptions":
        """Keep batch-norm running mean and variance in float32."""
        self._set(running_statistics_always_float=_bool_arg(
            "Precision.runningStatisticsAlwaysFloat", value))
        return self

    def enableFloatingPointExceptions(self,
                                      enabled: bool) -> "_PrecisionOptions":
        """Raise on floating point exceptions (inf - inf, x / 0, ...)."""
        self._popart.set(
            "enableFloatingPointChecks",
            _bool_arg("Precision.enableFloatingPointExceptions", enabled))
        return self

    def enableStochasticRounding(self, enabled: bool) -> "_PrecisionOptions":
        """Round float16 results stochastically."""
        self._popart.set(
            "enableStochasticRounding",
            _bool_arg("Precision.enableStochasticRounding", enabled))
        return self

    def setPartialsType(self, dtype: torch.dtype) -> "_PrecisionOptions":
        """Dtype of matmul and convolution partials: ``torch.float`` or
        ``torch.half`` (float16 matmuls then write float16 partials where they
        split the reduced dimension; the emulated convolutions keep float32)."""
        names = {torch.float32: "float", torch.float16: "half"}
        if dtype not in names:
            raise TypeError("Precision.setPartialsType expects torch.float or "
                            f"torch.half, got {dtype!r}.")
        self._popart.set("partialsTypeMatMuls", names[dtype])
        self._popart._merge("convolutionOptions",
                            {"partialsType": names[dtype]})
        return self


class _TrainingOptions(_OptionGroup):
    """Options of training models (``options.Training``)."""

    def __init__(self, popart: _PopartOptions):
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=ReductionType.Mean,
            # None: chosen when a model is built (poptorch_lite.api.optim.mean_reduction_strategy)
            mean_accumulation_and_replication_reduction_strategy=None)
        self._popart = popart

    gradient_accumulation = _value(
        "gradient_accumulation",
        "Micro-batches whose gradients are accumulated per weight update.")
    accumulation_and_replication_reduction_type = _value(
        "accumulation_and_replication_reduction_type",
        "ReductionType (Mean or Sum) over accumulated micro-batches and "
        "replicas.")
    mean_accumulation_and_replication_reduction_strategy = _value(
        "mean_accumulation_and_replication_reduction_strategy",
        "MeanReductionStrategy used when the reduction type is Mean (None: "
        "Running for float16 accumulation, else Post, chosen by the model).")

    @property
    def meanAccumulationAndReplicationReductionStrategy(
            self) -> Optional[MeanReductionStrategy]:
        """PopTorch's name of ``mean_accumulation_and_replication_reduction_
        strategy``."""
        return self.mean_accumulation_and_replication_reduction_strategy

    def gradientAccumulation(self, gradient_accumulation: int
                             ) -> "_TrainingOptions":
        """Accumulate the gradients of this many micro-batches before each
        weight update (a pipeline needs at least as many as it has stages)."""
        self._set(gradient_accumulation=_int_arg(
            "Training.gradientAccumulation", gradient_accumulation))
        return self

    def accumulationAndReplicationReductionType(
            self, reduction_type: ReductionType) -> "_TrainingOptions":
        """Reduce gradients over accumulation and replicas by ``Mean``
        (default) or ``Sum``."""
        self._set(accumulation_and_replication_reduction_type=_enum_arg(
            "Training.accumulationAndReplicationReductionType",
            reduction_type, ReductionType,
            excluded=(ReductionType.NoReduction, )))
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, strategy: MeanReductionStrategy) -> "_TrainingOptions":
        """When a ``Mean`` reduction divides (see ``MeanReductionStrategy``)."""
        self._set(mean_accumulation_and_replication_reduction_strategy=(
            _enum_arg(
                "Training.setMeanAccumulationAndReplicationReductionStrategy",
                strategy, MeanReductionStrategy)))
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> "_TrainingOptions":
        """Let the device pick the loss scaling factor."""
        self._popart.set(
            "automaticLossScalingSettings.enabled",
            _bool_arg("Training.setAutomaticLossScaling", enabled))
        return self

    def setConvolutionDithering(self, enabled: bool) -> "_TrainingOptions":
        """Start convolutions on different tiles to balance tile use."""
        self._popart._merge("convolutionOptions", {
            "enableConvDithering":
            _bool_arg("Training.setConvolutionDithering", enabled)
        })
        return self


class _DistributedOptions(_OptionGroup):
    """Multi-process options (``options.Distributed``).

    Defaults come from ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``.
    Under ``poprun`` use ``popdist.poptorch.Options``, which sets them for you.
    """

    def __init__(self):
        super().__init__(distributed_process_id=0, num_distributed_processes=1)
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    distributed_process_id = _value("distributed_process_id",
                                    "Same as processId.")
    num_distributed_processes = _value("num_distributed_processes",
                                       "Same as numProcesses.")

    @property
    def processId(self) -> int:
        """Id of this process, in ``[0, numProcesses)``."""
        return self._values["distributed_process_id"]

    @property
    def numProcesses(self) -> int:
        """Number of processes the run is distributed over."""
        return self._values["num_distributed_processes"]

    def disable(self) -> "_DistributedOptions":
        """Ignore the environment: run as process 0 of 1."""
        return self.configureProcessId(0, 1)

    def setEnvVarNames(self, var_num_processes: str,
                       var_process_id: str) -> "_DistributedOptions":
        """Read the process count and id from these environment variables
        (unset variables mean 1 process, id 0)."""

        def read(name: str, default: int) -> int:
            text = os.environ.get(name, "").strip()
            if not text:
                return default
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"Environment variable {name}={text!r} is "
                                 f"not an integer.") from None

        return self.configureProcessId(read(var_process_id, 0),
                                       read(var_num_processes, 1))

    def configureProcessId(self, process_id: int,
                           num_processes: int) -> "_DistributedOptions":
        """Make this process number ``process_id`` of ``num_processes``."""
        num_processes = _int_arg("Distributed.configureProcessId: "
                                 "num_processes", num_processes)
        process_id = _int_arg("Distributed.configureProcessId: process_id",
                              process_id,
                              minimum=0)
        if process_id >= num_processes:
            raise ValueError(
                f"Distributed.configureProcessId: process_id ({process_id}) "
                f"must be smaller than num_processes ({num_processes}).")
        self._set(distributed_process_id=process_id,
                  num_distributed_processes=num_processes)
        return self


class TensorLocationSettings(_OptionGroup):
    """Where a class of tensors is stored; pass it to a ``TensorLocations``
    setter.

    >>> TensorLocationSettings().useOnChipStorage(False)
    """

    def __init__(self):
        super().__init__(on_chip=None,
                         use_replicated_tensor_sharding=None,
                         min_elements_for_off_chip=None,
                         min_elements_for_replicated_tensor_sharding=None,
                         use_io_tiles_to_load=None,
                         use_io_tiles_to_store=None)

    on_chip = _value("on_chip", "True: on chip, False: Streaming Memory, "
                     "None: let the compiler choose.")
    use_replicated_tensor_sharding = _value(
        "use_replicated_tensor_sharding",
        "Whether the tensors are sharded across replicas.")
    min_elements_for_off_chip = _value(
        "min_elements_for_off_chip",
        "Tensors smaller than this stay on chip.")
    min_elements_for_replicated_tensor_sharding = _value(
        "min_elements_for_replicated_tensor_sharding",
        "Tensors smaller than this are not sharded.")
    use_io_tiles_to_load = _value("use_io_tiles_to_load",
                                  "Whether loads go through I/O tiles.")
    use_io_tiles_to_store = _value("use_io_tiles_to_store",
                                   "Whether stores go through I/O tiles.")

    # PopTorch's names for the settings (``settings["onChip"]``)
    _KEYS = {"onChip": "on_chip",
             "useReplicatedTensorSharding": "use_replicated_tensor_sharding",
             "minElementsForOffChip": "min_elements_for_off_chip",
             "minElementsForReplicatedTensorSharding":
             "min_elements_for_replicated_tensor_sharding",
             "useIOTilesToLoad": "use_io_tiles_to_load",
             "useIOTilesToStore": "use_io_tiles_to_store"}

    def __getitem__(self, key: str):
        """A setting by PopTorch's name (``"onChip"``, ...); KeyError if unset."""
        if key not in self._KEYS:
            raise KeyError(f"TensorLocationSettings has no setting {key!r}; "
                           f"settings: {', '.join(self._KEYS)}.")
        value = self._values[self._KEYS[key]]
        if value is None:
            raise KeyError(f"TensorLocationSettings: {key!r} is not set.")
        return value

    def useOnChipStorage(self,
                         use: Optional[bool] = True
                         ) -> "TensorLocationSettings":
        """True: keep on chip; False: Streaming Memory; None: undecided."""
        if use is not None:
            _bool_arg("TensorLocationSettings.useOnChipStorage", use)
        self._set(on_chip=use)
        return self

    def useReplicatedTensorSharding(self, use: bool = True
                                    ) -> "TensorLocationSettings":
        """Shard the tensors across replicas (weights, optimiser state)."""
        self._set(use_replicated_tensor_sharding=_bool_arg(
            "TensorLocationSettings.useReplicatedTensorSharding", use))
        return self

    def minElementsForOffChip(self, min_elements: int
                              ) -> "TensorLocationSettings":
        """Keep tensors with fewer elements than this on chip."""
        self._set(min_elements_for_off_chip=_int_arg(
            "TensorLocationSettings.minElementsForOffChip", min_elements, 0))
        return self

    def minElementsForReplicatedTensorSharding(
            self, min_elements: int) -> "TensorLocationSettings":
        """Shard only tensors with at least this many elements."""
        self._set(min_elements_for_replicated_tensor_sharding=_int_arg(
            "TensorLocationSettings.minElementsForReplicatedTensorSharding",
            min_elements, 0))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> "TensorLocationSettings":
        """Load the tensors through I/O tiles."""
        self._set(use_io_tiles_to_load=_bool_arg(
            "TensorLocationSettings.useIOTilesToLoad", use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> "TensorLocationSettings":
        """Store the tensors through I/O tiles."""
        self._set(use_io_tiles_to_store=_bool_arg(
            "TensorLocationSettings.useIOTilesToStore", use))
        return self


_TENSOR_CLASSES = ("activation", "weight", "optimizer", "accumulator")


class _TensorLocationOptions(_OptionGroup):
    """Where tensors live (``options.TensorLocations``)."""

    def __init__(self):
        super().__init__(num_io_tiles=0,
                         **{f"location_{c}": None
                            for c in _TENSOR_CLASSES})

    num_io_tiles = _value("num_io_tiles", "Tiles reserved for I/O per IPU.")
    location_activation = _value("location_activation",
                                 "Settings for activations, or None.")
    location_weight = _value("location_weight", "Settings for weights, or None.")
    location_optimizer = _value("location_optimizer",
                                "Settings for optimiser state, or None.")
    location_accumulator = _value("location_accumulator",
                                  "Settings for accumulators, or None.")

    def _location(self, tensor_class: str, location) -> None:
        if not isinstance(location, TensorLocationSettings):
            raise TypeError(
                f"TensorLocations.set{tensor_class.title()}Location expects "
                f"a TensorLocationSettings, for example "
                f"TensorLocationSettings().useOnChipStorage(False); got "
                f"{location!r}.")
        settings = copy.deepcopy(location)
        settings._set_frozen(False)
        self._set(**{f"location_{tensor_class}": settings})

    def numIOTiles(self, num_tiles: int) -> "_TensorLocationOptions":
        """Reserve ``num_tiles`` tiles per IPU for I/O (even, 32 to 192)."""
        num_tiles = _int_arg("TensorLocations.numIOTiles", num_tiles, 0)
        if not 32 <= num_tiles <= 192 or num_tiles % 2:
            # an AssertionError in PopTorch's words, as PopTorch raises it
            raise AssertionError("numIOTiles must be an even number between "
                                 f"32 and 192 (TensorLocations.numIOTiles got "
                                 f"{num_tiles}).")
        self._set(num_io_tiles=num_tiles)
        return self

    def setActivationLocation(self, location: TensorLocationSettings
                              ) -> "_TensorLocationOptions":
        """Where activations live."""
        self._location("activation", location)
        return self

    def setWeightLocation(self, location: TensorLocationSettings
                          ) -> "_TensorLocationOptions":
        """Where weights live."""
        self._location("weight", location)
        return self

    def setOptimizerLocation(self, location: TensorLocationSettings
                             ) -> "_TensorLocationOptions":
        """Where optimiser state lives."""
        self._location("optimizer", location)
        return self

    def setAccumulatorLocation(self, location: TensorLocationSettings
                               ) -> "_TensorLocationOptions":
        """Where gradient accumulators live."""
        self._location("accumulator", location)
        return self


EMULATOR_MODES = ("fast", "strict", "estimate")


class _EmulatorOptions(_OptionGroup):
    """What PopTorch does not have: the emulated IPU and how the emulator runs
    (``options.Emulator``). Defaults come from ``IPUSIM_TARGET``,
    ``IPUSIM_MODE`` and ``IPUSIM_HOST_THREADS``."""

    def __init__(self):
        super().__init__(target=os.environ.get("IPUSIM_TARGET") or None,
                         mode=os.environ.get("IPUSIM_MODE", "fast"),
                         host_threads=_host_threads("IPUSIM_HOST_THREADS", os.environ.get("IPUSIM_HOST_THREADS",
                                                                                         AUTO_THREADS)),
                         pipeline_schedule="PopTorch")
        if self._values["mode"] not in EMULATOR_MODES:
            raise ValueError(f"IPUSIM_MODE must be 'fast', 'strict' or 'estimate', got {self._values['mode']!r}")

    target = _value("target", "Target name or ipusim.Target, None for the default (GC200, or Mk1 for "
                              "useOfflineIpuTarget(1)).")
    mode = _value("mode", "'fast' (default), 'strict' (every tile mapping and exchange checked) or 'estimate' "
                          "(programs, memory and cycles without values: see docs/estimating.md).")
    host_threads = _value("host_threads", "Host threads running the IPUs of one step concurrently, or 'auto' "
                                          "(default): one, or one per core (at most one per op of the widest "
                                          "step), whichever timed calls find faster (up to three pairs "
                                          "when close).")
    pipeline_schedule = _value("pipeline_schedule", "The schedule a pipelined training model runs: 'PopTorch' "
                                                    "(default) or a kind of ipusim.schedules.TRAINING_KINDS.")

    def setTarget(self, target) -> "_EmulatorOptions":
        """Emulate this IPU: a preset name ('GC200', 'Bow', 'GC2', ...) or an ipusim.Target."""
        import ipusim  # pylint: disable=import-outside-toplevel
        if isinstance(target, str):
            ipusim.get_target(target)  # validates the name
        elif not isinstance(target, ipusim.Target):
            raise TypeError(f"Emulator.setTarget expects a target name or an ipusim.Target, got {target!r}")
        self._set(target=target)
        return self

    def setMode(self, mode: str) -> "_EmulatorOptions":
        """'fast' runs each op's whole-tensor kernel; 'strict' runs every vertex from its tile's memory;
        'estimate' builds the same programs and accounts the same memory and cycles but computes no
        values and allocates no tensor storage (a call returns meta tensors; docs/estimating.md)."""
        if mode not in EMULATOR_MODES:
            raise ValueError(f"Emulator.setMode: mode must be 'fast', 'strict' or 'estimate', got {mode!r}")
        self._set(mode=mode)
        return self

    def setHostThreads(self, threads) -> "_EmulatorOptions":
        """Run the emulated IPUs of one pipeline step on this many host threads, or "auto": after
        compiling, time one call on one thread and one on a thread per core this process may use
        (at most one per op of the widest step), up to three such pairs when they are close, and
        keep the faster (see poptorch_lite.runtime.step_threads)."""
        self._set(host_threads=_host_threads("Emulator.setHostThreads", threads))
        return self

    def setPipelineSchedule(self, kind: str) -> "_EmulatorOptions":
        """Train a PipelinedExecution model under this schedule: "PopTorch" (the default,
        PopTorch's own), "GPipe", "1F1B", "ZB-H1", "ZB-H2" (stage s on IPU s) or
        "Interleaved1F1B" (stage s on IPU s mod N). The zero-bubble kinds run each stage's
        backward as an input-gradient and a weight-gradient program. Inference always runs
        PopTorch's schedule. See docs/schedules.md."""
        from ipusim.schedules import TRAINING_KINDS  # pylint: disable=import-outside-toplevel
        kinds = ("PopTorch",) + TRAINING_KINDS
        if kind not in kinds:
            raise ValueError(f"Emulator.setPipelineSchedule: unknown schedule {kind!r}; use one of "
                             f"{', '.join(repr(k) for k in kinds)}")
        self._set(pipeline_schedule=kind)
        return self


def _engine_options_from_env() -> Dict[str, Any]:
    text = os.environ.get("POPLAR_ENGINE_OPTIONS", "").strip()
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"POPLAR_ENGINE_OPTIONS is not valid JSON ({error}): "
                         f"{text!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError("POPLAR_ENGINE_OPTIONS must be a JSON object, for "
                         'example {"autoReport.all":"true"}; got '
                         f"{text!r}.")
    return parsed


class Options(_OptionGroup):
    """Everything that controls how a model is compiled and run.

    >>> opts = Options().deviceIterations(4).replicationFactor(2)
    >>> opts.Training.gradientAccumulation(8)
    """

    def __init__(self):
        super().__init__(device_iterations=1,
                         replication_factor=1,
                         log_dir=".",
                         auto_round_num_ipus=False,
                         output_mode=OutputMode.Default,
                         output_return_period=1,
                         random_seed=None,
                         use_model=None,
                         connection_type=ConnectionType.Always,
                         ipu_version=None,
                         ipu_id=None,
                         sync_pattern=SyncPattern.Full,
                         available_memory_proportion={},
                         anchored_tensors={},
                         model_name=None,
                         broadcast_buffers=True,
                         show_compilation_progress_bar=True,
                         relax_optimizer_attributes_checks=False,
                         module_namescope=True,
                         input_group_size=1,
                         input_cgt=CommGroupType.Consecutive,
                         max_repeat_logs=DEFAULT_REPEAT_LOGS,
                         source_location_excludes=list(
                             DEFAULT_SOURCE_LOCATION_EXCLUDES))
        self._popart = _PopartOptions()
        self._jit = _JitOptions()
        self._precision = _PrecisionOptions(self._popart)
        self._training = _TrainingOptions(self._popart)
        self._distributed = _DistributedOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._emulator = _EmulatorOptions()
        self._execution_strategy = strategies.PipelinedExecution(enums.AutoStage.SameAsIpu)
        cache_dir = os.environ.get("POPTORCH_CACHE_DIR", "")
        if cache_dir:
            self.enableExecutableCaching(cache_dir)
        defaults = os.environ.get("POPTORCH_DEFAULT_OPTIONS", "").strip()
        if defaults:
            _apply_json(self, defaults, "POPTORCH_DEFAULT_OPTIONS")

    # --- option groups -------------------------------------------------

    @property
    def Training(self) -> _TrainingOptions:
        """Options of training models."""
        return self._training

    @property
    def Distributed(self) -> _DistributedOptions:
        """Multi-process options."""
        return self._distributed

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Where tensors live."""
        return self._tensor_locations

    @property
    def Emulator(self) -> _EmulatorOptions:
        """The emulated target and how the emulator runs (not in PopTorch)."""
        return self._emulator

    @property
    def Precision(self) -> _PrecisionOptions:
        """Numerical precision options."""
        return self._precision

    @property
    def Jit(self) -> _JitOptions:
        """Model capture options."""
        return self._jit

    @property
    def _Popart(self) -> _PopartOptions:
        """PopART session options (advanced users): checked against the
        options PopTorch passes to PopART when a model is made; see popart.py
        for what the emulator does with each."""
        return self._popart

    # --- values read by the runtime --------------------------------------

    device_iterations = _value(
        "device_iterations", "Iterations the device runs per model call.")
    replication_factor = _value("replication_factor",
                                "Number of data-parallel replicas.")
    output_mode = _value("output_mode",
                         "OutputMode (Default until a model resolves it).")
    output_return_period = _value(
        "output_return_period", "N of OutputMode.EveryN (1 otherwise).")
    random_seed = _value("random_seed",
                         "Seed given to randomSeed(), or None if unset.")
    log_dir = _value("log_dir", "Directory for log files.")
    auto_round_num_ipus = _value(
        "auto_round_num_ipus", "Round the IPU count up to a power of two.")
    use_model = _value("use_model",
                       "useIpuModel() setting, or None if never set.")
    connection_type = _value("connection_type",
                             "When to attach to the device.")
    ipu_version = _value("ipu_version",
                         "Offline target version (1: Mk1, 2: Mk2) or None.")
    ipu_id = _value("ipu_id", "Device id given to useIpuId(), or None.")
    sync_pattern = _value("sync_pattern", "IPU synchronisation pattern.")
    model_name = _value("model_name", "Name used for profile directories.")
    broadcast_buffers = _value("broadcast_buffers",
                               "Broadcast buffers to all replicas.")
    show_compilation_progress_bar = _value(
        "show_compilation_progress_bar", "Show a compilation progress bar.")
    relax_optimizer_attributes_checks = _value(
        "relax_optimizer_attributes_checks",
        "Log unexpected optimiser attributes at debug level only.")
    module_namescope = _value("module_namescope",
                              "Name ops after the modules they come from.")
    input_group_size = _value(
        "input_group_size", "Replicas per input replica group "
        "(inputReplicaGrouping; 1: every replica its own input).")
    input_cgt = _value("input_cgt", "CommGroupType of the input replica "
                       "groups (inputReplicaGrouping).")
    max_repeat_logs = _value(
        "max_repeat_logs", "Times a repeated log line is shown before it "
        "is suppressed (None: always shown).")

    @property
    def source_location_excludes(self) -> list:
        """Path fragments of the frames skipped when an op's source line is
        looked up (sourceLocationExcludes)."""
        return list(self._values["source_location_excludes"])

    @property
    def available_memory_proportion(self) -> Dict[int, float]:
        """Temporary-memory proportion per IPU id."""
        return dict(self._values["available_memory_proportion"])

    @property
    def gradient_accumulation(self) -> int:
        """Same as ``Training.gradient_accumulation``."""
        return self._training.gradient_accumulation

    @property
    def process_id(self) -> int:
        """Same as ``Distributed.processId``."""
        return self._distributed.processId

    @property
    def num_processes(self) -> int:
        """Same as ``Distributed.numProcesses``."""
        return self._distributed.numProcesses

    @property
    def execution_strategy(self):
        """The execution strategy; ``PipelinedExecution(AutoStage.SameAsIpu)``
        unless ``setExecutionStrategy`` chose another."""
        return self._execution_strategy

    @property
    def cache_path(self) -> Optional[str]:
        """Executable cache directory, or None when caching is off."""
        if not self._popart.get("enableEngineCaching", False):
            return None
        return self._popart.get("cachePath")

    @property
    def profile_dir(self) -> Optional[str]:
        """Directory profiling reports go to, or None when profiling is off.

        ``POPLAR_ENGINE_OPTIONS`` (``autoReport.all``, ``autoReport.output*``,
        ``autoReport.directory``) takes precedence over ``enableProfiling``.
        """
        engine = dict(self._popart.get("engineOptions", {}))
        engine.update(_engine_options_from_env())
        enabled = any(
            str(value).strip().lower() == "true"
            for key, value in engine.items()
            if key == "autoReport.all" or key.startswith("autoReport.output"))
        if not enabled:
            return None
        return str(engine.get("autoReport.directory", "."))

    @property
    def synthetic_data(self) -> bool:
        """Whether host I/O is replaced by data generated on the device."""
        return self._popart.get("syntheticDataMode", 0) != 0

    @property
    def tensor_locations(self) -> Dict[str, Optional[TensorLocationSettings]]:
        """Settings per tensor class (``activation``, ``weight``,
        ``optimizer``, ``accumulator``); None where unset."""
        return {
            c: self._tensor_locations._values[f"location_{c}"]
            for c in _TENSOR_CLASSES
        }

    def defaultOutputMode(self) -> bool:
        """True while the output mode is ``OutputMode.Default``."""
        return self.output_mode == OutputMode.Default

    # --- setters -------------------------------------------------------

    def deviceIterations(self, device_iterations: int) -> "Options":
        """Run the device this many times per model call, each time on a new
        micro-batch (multiplies the batch a call consumes)."""
        self._set(device_iterations=_int_arg("Options.deviceIterations",
                                             device_iterations))
        return self

    @property
    def input_groups(self) -> int:
        """How many different inputs the replicas get: replicationFactor / input_group_size."""
        return self.replication_factor // self.input_group_size

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: CommGroupType) -> "Options":
        """Give each group of ``input_group_size`` replicas the same input: ``Consecutive`` groups
        replicas {0 .. k-1}, {k .. 2k-1}, ...; ``Orthogonal`` groups {j, j + m, ...} for
        m = replicationFactor / k; ``NoGrouping`` means groups of one. A call then consumes
        micro_batch x deviceIterations x (replicationFactor / k) x gradientAccumulation samples.
        Set ``replicationFactor`` first: k must divide it."""
        group_type = _enum_arg("Options.inputReplicaGrouping: input_group_type",
                               input_group_type, CommGroupType)
        size = _int_arg("Options.inputReplicaGrouping: input_group_size",
                        input_group_size)
        if group_type == CommGroupType.NoGrouping:
            size, group_type = 1, CommGroupType.Consecutive
        if group_type == CommGroupType.All:
            raise ValueError("Options.inputReplicaGrouping: input_group_type cannot be All (inputs are split "
                             "between groups); use CommGroupType.Consecutive or Orthogonal.")
        replicas = self.replication_factor
        if replicas < size:
            raise ValueError(f"Options.inputReplicaGrouping: input_group_size cannot be larger than "
                             f"replication_factor ({size} > {replicas}); set replicationFactor first.")
        if replicas % size:
            raise ValueError(f"Options.inputReplicaGrouping: input_group_size must be a factor of "
                             f"replication_factor ({size} does not divide {replicas}).")
        self._set(input_group_size=size, input_cgt=group_type)
        return self

    def replicationFactor(self, replication_factor: int) -> "Options":
        """Replicate the model this many times for data parallelism
        (multiplies the batch a call consumes and the IPUs used)."""
        self._set(replication_factor=_int_arg("Options.replicationFactor",
                                              replication_factor))
        return self

    @property
    def anchored_tensors(self) -> Dict[str, tuple]:
        """``anchorTensor``'s entries: short name -> (long name, OutputMode
        or None for the model's, return period)."""
        return dict(self._values["anchored_tensors"])

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[OutputMode] = None,
                     output_return_period: Optional[int] = 1) -> "Options":
        """Return the device tensor ``long_name`` from every run, read with
        ``model.getAnchoredTensor(short_name)``. The tensors a model can
        anchor are named as in PopART: ``Gradient___<parameter>`` (the
        gradient a weight update applies) and ``UpdatedVar___<parameter>``
        (the parameter after the update), one value per weight update;
        ``output_mode`` (the model's output mode when None) picks which."""
        for what, name in (("short_name", short_name), ("long_name", long_name)):
            if not isinstance(name, str) or not name:
                raise TypeError(f"Options.anchorTensor: {what} must be a "
                                f"non-empty str, got {name!r}.")
        if output_mode is not None:
            _enum_arg("Options.anchorTensor: output_mode", output_mode,
                      OutputMode)
        period = 1
        if output_mode == OutputMode.EveryN:
            period = _int_arg("Options.anchorTensor: output_return_period",
                              output_return_period)
        self._set(anchored_tensors={**self._values["anchored_tensors"],
                                    short_name: (long_name, output_mode,
                                                 period)})
        return self

    def outputMode(self,
                   output_mode: OutputMode,
                   output_return_period: Optional[int] = None) -> "Options":
        """Which results a call returns; ``EveryN`` needs
        ``output_return_period`` (N). The other modes ignore a period, as
        PopTorch does (it is logged at info level)."""
        mode = _enum_arg("Options.outputMode", output_mode, OutputMode)
        if mode == OutputMode.EveryN:
            if output_return_period is None:
                raise ValueError(
                    "Options.outputMode(OutputMode.EveryN, N) needs the "
                    "return period N: results are returned every N device "
                    "iterations.")
            period = _int_arg("Options.outputMode: output_return_period",
                              output_return_period)
        else:
            if output_return_period is not None:
                logger.info(
                    "Options.outputMode: output_return_period %r ignored: "
                    "only OutputMode.EveryN uses it, not OutputMode.%s",
                    output_return_period, mode.name)
            period = 1
        self._set(output_mode=mode, output_return_period=period)
        return self

    def randomSeed(self, random_seed: int) -> "Options":
        """Seed the device's random generator; also seeds torch, and fixes
        the DataLoader's distributed shuffling."""
        if isinstance(random_seed, bool) or not isinstance(
                random_seed, numbers.Integral):
            raise TypeError(f"Options.randomSeed expects an int, got "
                            f"{random_seed!r}.")
        if not -2**63 <= random_seed < 2**64:
            raise ValueError("Options.randomSeed expects a seed in "
                             f"[-2**63, 2**64), got {random_seed}.")
        self._check_mutable()
        torch.manual_seed(int(random_seed))
        self._set(random_seed=int(random_seed))
        return self

    def setExecutionStrategy(self, strategy) -> "Options":
        """How the model's blocks are spread over IPUs: a
        ``PipelinedExecution``, ``ShardedExecution``,
        ``SerialPhasedExecution`` or ``ParallelPhasedExecution``."""
        if not isinstance(strategy, strategies.ExecutionStrategy):
            raise TypeError(
                "Options.setExecutionStrategy expects an execution strategy "
                "(PipelinedExecution, ShardedExecution, SerialPhasedExecution "
                f"or ParallelPhasedExecution), got {strategy!r}.")
        self._check_mutable()
        object.__setattr__(self, "_execution_strategy", strategy)
        return self

    def useIpuModel(self, use_model: bool) -> "Options":
        """Recorded for PopTorch compatibility: every device here is emulated."""
        self._set(use_model=_bool_arg("Options.useIpuModel", use_model))
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> "Options":
        """Compile for an IPU version without running (1: Mk1 GC2, 2: Mk2
        GC200); sets ``connectionType(ConnectionType.Never)``."""
        if ipu_version not in (1, 2) or isinstance(ipu_version, bool):
            raise ValueError("Options.useOfflineIpuTarget expects ipu_version "
                             f"1 (Mk1) or 2 (Mk2), got {ipu_version!r}.")
        self._set(connection_type=ConnectionType.Never,
                  ipu_version=int(ipu_version))
        return self

    def connectionType(self, connection_type: ConnectionType) -> "Options":
        """When to attach to the device."""
        self._set(connection_type=_enum_arg("Options.connectionType",
                                            connection_type, ConnectionType))
        return self

    def syncPattern(self, sync_pattern: SyncPattern) -> "Options":
        """How IPUs synchronise with each other and the host."""
        self._set(sync_pattern=_enum_arg("Options.syncPattern", sync_pattern,
                                         SyncPattern))
        return self

    def useIpuId(self, ipu_id: int) -> "Options":
        """Use the device with this id."""
        self._set(ipu_id=_int_arg("Options.useIpuId", ipu_id, 0))
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> "Options":
        """Round the number of IPUs up to a power of two instead of failing."""
        self._set(auto_round_num_ipus=_bool_arg("Options.autoRoundNumIPUs",
                                                auto_round_num_ipus))
        return self

    def logDir(self, log_dir: str) -> "Options":
        """Directory for log files."""
        self._set(log_dir=_path_arg("Options.logDir", log_dir))
        return self

    def modelName(self, name: str) -> "Options":
        """Name of the model (the profile sub-directory)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"Options.modelName expects a non-empty str, got "
                            f"{name!r}.")
        self._set(model_name=name)
        return self

    def enableExecutableCaching(self, path: Optional[str]) -> "Options":
        """Cache compiled executables in directory ``path``; None disables."""
        if path is None:
            self._popart.set("enableEngineCaching", False)
        else:
            self._popart.set("cachePath",
                             _path_arg("Options.enableExecutableCaching",
                                       path))
            self._popart.set("enableEngineCaching", True)
        return self

    def enableProfiling(self, profile_dir: Optional[str] = None) -> "Options":
        """Write profiling reports to ``profile_dir`` (default: current
        directory). ``POPLAR_ENGINE_OPTIONS`` overrides it when it sets
        ``autoReport.*``."""
        directory = "." if profile_dir is None else _path_arg(
            "Options.enableProfiling", profile_dir)
        if any(key.startswith("autoReport.")
               for key in _engine_options_from_env()):
            logger.warning("Profiling settings in POPLAR_ENGINE_OPTIONS take "
                           "precedence over Options.enableProfiling(%r).",
                           directory)
        self._popart.setEngineOptions({
            "debug.allowOutOfMemory": "true",
            "autoReport.directory": directory,
            "autoReport.all": "true",
        })
        return self

    def enableSyntheticData(self, enabled: bool) -> "Options":
        """Replace host I/O by random data generated on the device."""
        self._popart.set(
            "syntheticDataMode",
            2 if _bool_arg("Options.enableSyntheticData", enabled) else 0)
        return self

    def enableStableNorm(self, enabled: bool) -> "Options":
        """Use the slower, more accurate norm implementations."""
        self._popart.set("enableStableNorm",
                         _bool_arg("Options.enableStableNorm", enabled))
        return self

    def logCycleCount(self, log_cycle_count: bool) -> "Options":
        """Log the cycles the device spends per run."""
        self._popart.set(
            "instrumentWithHardwareCycleCounter",
            _bool_arg("Options.logCycleCount", log_cycle_count))
        return self

    def setAvailableMemoryProportion(
            self, available_memory_proportion: Dict[str, float]) -> "Options":
        """Temporary memory for matmuls and convolutions per IPU, as a
        proportion in (0, 1]: ``{"IPU0": 0.3, "IPU1": 0.6}``."""
        if not isinstance(available_memory_proportion, dict):
            raise TypeError("Options.setAvailableMemoryProportion expects a "
                            'dict such as {"IPU0": 0.5}, got '
                            f"{available_memory_proportion!r}.")
        per_ipu = {}
        for key, proportion in available_memory_proportion.items():
            if not (isinstance(key, str) and key.startswith("IPU")
                    and key[3:].isdigit()):
                raise ValueError("Options.setAvailableMemoryProportion: keys "
                                 f'are "IPU<n>" (for example "IPU0"), got '
                                 f"{key!r}.")
            if isinstance(proportion, bool) or not isinstance(
                    proportion, numbers.Real) or not 0 < proportion <= 1:
                raise ValueError("Options.setAvailableMemoryProportion: "
                                 f"{key} must be a number in (0, 1], got "
                                 f"{proportion!r}.")
            per_ipu[int(key[3:])] = float(proportion)
        self._set(available_memory_proportion=per_ipu)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> "Options":
        """Broadcast buffers (for example batch-norm statistics) to replicas."""
        self._set(broadcast_buffers=_bool_arg("Options.broadcastBuffers",
                                              broadcast_buffers))
        return self

    def showCompilationProgressBar(self, show: bool = True) -> "Options":
        """Show or hide the compilation progress bar."""
        self._set(show_compilation_progress_bar=_bool_arg(
            "Options.showCompilationProgressBar", show))
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> "Options":
        """Log unexpected optimiser attributes at debug level only."""
        self._set(relax_optimizer_attributes_checks=_bool_arg(
            "Options.relaxOptimizerAttributesChecks", relax))
        return self

    def disableModuleNamescope(self) -> "Options":
        """Do not prefix op names with the names of their modules."""
        self._set(module_namescope=False)
        return self

    def from_json(self, string: str) -> "Options":
        """Apply a JSON object of setter name to arguments, as
        ``POPTORCH_DEFAULT_OPTIONS`` does: ``'{"deviceIterations": 4,
        "Training.gradientAccumulation": 8, "_Popart.set": ["key", 1],
        "outputMode": "OutputMode.All"}'`` (a list gives several arguments;
        ``"Enum.Member"`` names an enum member)."""
        if not isinstance(string, (str, bytes, bytearray)):
            raise TypeError("Options.from_json expects a JSON string, got "
                            f"{string!r}.")
        _apply_json(self, string, "Options.from_json")
        return self

    def updatableNamedBuffers(self, buffers) -> "Options":
        """Buffers (by name, as in ``model.named_buffers()``) that
        ``model.copyNamedBuffersToDevice()`` writes to the device without
        the other weights."""
        if isinstance(buffers, str) or not all(
                isinstance(b, str) and b for b in buffers):
            raise TypeError("Options.updatableNamedBuffers expects a list of "
                            f"buffer names (str), got {buffers!r}.")
        self._popart.set("updatableNamedBuffers", list(buffers))
        return self

    def sourceLocationExcludes(self, excludes) -> "Options":
        """Replace the path fragments of the frames skipped when an op's
        source line is looked up (for error messages, op placement and the
        profile): a frame whose file name contains one is a library's, not
        the user's. The default skips torch and poptorch_lite."""
        self._set(source_location_excludes=_excludes(
            "Options.sourceLocationExcludes", excludes))
        return self

    def appendToLocationExcludes(self, *excludes: str) -> "Options":
        """Add path fragments to ``sourceLocationExcludes``."""
        self._set(source_location_excludes=self.source_location_excludes +
                  _excludes("Options.appendToLocationExcludes", excludes))
        return self

    def maxRepeatLogs(self, max_lines: Optional[int]) -> "Options":
        """Show a log line that repeats (the same warning for many ops, ...)
        at most ``max_lines`` times, then say that further repeats are
        suppressed; None shows them all. Default 4. It applies from the
        moment a model with these options is built."""
        if max_lines is not None:
            max_lines = _int_arg("Options.maxRepeatLogs", max_lines, 0)
        self._set(max_repeat_logs=max_lines)
        return self

    def exists(self, option: str) -> bool:
        """Whether ``option`` (a value name such as ``"random_seed"``) has
        been given a value."""
        return self._values.get(option) is not None

    def checkIsFrozen(self) -> None:
        """Raise ``AttributeError`` if these options are frozen (a model or
        a DataLoader uses them)."""
        self._check_mutable()

    def loadFromFile(self, filepath: str) -> "Options":
        """Apply a file of setter calls, one per line without the
        ``options.`` prefix, for example ``deviceIterations(4)`` or
        ``outputMode(poptorch.OutputMode.All)``; ``#`` starts a comment."""
        path = _path_arg("Options.loadFromFile", filepath)
        with open(path, encoding="utf-8") as config:
            lines = config.read().splitlines()
        name = os.path.basename(path)
        for number, line in enumerate(lines, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            where = f"line {number} of {name}"
            try:
                tree = ast.parse("options." + text, mode="eval")
            except SyntaxError as error:
                raise ConfigFileError(f"SyntaxError at {where}: {error.msg}\n"
                                      f"> options.{text}") from None
            try:
                _ConfigEvaluator(self).apply(tree.body)
            except (ValueError, TypeError, AttributeError) as error:
                raise ConfigFileError(f"{type(error).__name__} at {where}: "
                                      f"{error}\n> options.{text}") from error
        return self

    # --- lifecycle -----------------------------------------------------

    def _freeze(self) -> None:
        """Refuse further changes (called by models and DataLoaders)."""
        self._set_frozen(True)

    def clone(self) -> "Options":
        """An unfrozen deep copy (as ``copy.deepcopy``)."""
        return copy.deepcopy(self)

    def __deepcopy__(self, memo) -> "Options":
        """A copy is new options, unfrozen even when these are (as in
        PopTorch): only the model or DataLoader given them holds them."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            object.__setattr__(copied, name, copy.deepcopy(value, memo))
        copied._set_frozen(False)
        return copied

    def toDict(self) -> Dict[str, Any]:
        """Every option as plain data."""
        out = super().toDict()
        out["execution_strategy"] = repr(self.execution_strategy)
        # PopTorch's number for the kind of strategy: 0 pipelined, 1 sharded, 2 phased
        strategy = self.execution_strategy
        out["execution_mode"] = 1 if isinstance(strategy, strategies.ShardedExecution) else (
            0 if isinstance(strategy, strategies.PipelinedExecution) else 2)
        out["Training"] = self._training.toDict()
        out["Distributed"] = self._distributed.toDict()
        out["TensorLocations"] = self._tensor_locations.toDict()
        out["Precision"] = self._precision.toDict()
        out["Jit"] = self._jit.toDict()
        out["Emulator"] = {k: str(v) if v is not None and not isinstance(v, (str, int)) else v
                           for k, v in self._emulator.toDict().items()}
        out["_Popart"] = self._popart.toDict()
        return out

    def __repr__(self):
        groups = {
            "Training": self._training,
            "Distributed": self._distributed,
            "TensorLocations": self._tensor_locations,
            "Precision": self._precision,
            "Jit": self._jit,
            "Emulator": self._emulator,
            "_Popart": self._popart,
        }
        body = [f"{k}={v!r}" for k, v in self._values.items()]
        body.append(f"execution_strategy={self._execution_strategy!r}")
        body += [f"{k}={v!r}" for k, v in groups.items()]
        return "Options(" + ", ".join(body) + ")"


# --- POPTORCH_DEFAULT_OPTIONS and loadFromFile --------------------------


def _enum_member(text: str):
    """``"OutputMode.All"`` (optionally prefixed by ``poptorch.``) -> member,
    or None if ``text`` does not name a poptorch_lite enum."""
    parts = text.split(".")
    if parts[0] in ("poptorch", "poptorch_lite"):
        parts = parts[1:]
    if len(parts) != 2:
        return None
    enum_class = getattr(enums, parts[0], None)
    if not (isinstance(enum_class, type) and issubclass(enum_class, enum.Enum)):
        return None
    if parts[1] not in enum_class.__members__:
        raise ValueError(f"{parts[0]} has no member {parts[1]!r}; members: "
                         f"{', '.join(enum_class.__members__)}.")
    return enum_class[parts[1]]


def _setter(options: Options, path: str):
    """Resolve ``"Training.gradientAccumulation"`` to a bound setter."""
    target = options
    for name in path.split("."):
        if name.startswith("_") and name != "_Popart":
            raise AttributeError(f"{path!r} is not an option setter.")
        if not hasattr(target, name):
            raise AttributeError(f"unknown option {path!r}.")
        target = getattr(target, name)
    if not callable(target) or isinstance(target, _OptionGroup):
        raise AttributeError(f"{path!r} is not an option setter.")
    return target


def _apply_json(options: Options, text: str, where: str) -> None:
    """Apply a JSON object of setter path -> arguments (``Options.from_json``;
    ``POPTORCH_DEFAULT_OPTIONS``); errors name `where` and the setter."""
    try:
        calls = json.loads(text)
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"{where} is not valid JSON "
                         f"({error}): {text!r}") from None
    if not isinstance(calls, dict):
        raise ValueError(f"{where} must be a JSON object of "
                         'setter name to arguments, such as '
                         '{"deviceIterations": 4}; got ' + repr(text))

    def convert(value):
        if isinstance(value, str):
            member = _enum_member(value)
            return value if member is None else member
        if isinstance(value, list):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    for path, arguments in calls.items():
        try:
            setter = _setter(options, path)
            arguments = convert(arguments)
            if isinstance(arguments, list):
                setter(*arguments)
            else:
                setter(arguments)
        except (ValueError, TypeError, AttributeError) as error:
            raise type(error)(f"{where}, {path!r}: {error}"
                              ) from None


class _ConfigEvaluator:
    """Evaluates one ``options.<setter>(<args>)`` line of a config file.

    Arguments may be literals, enum members (``poptorch.OutputMode.All``),
    torch dtypes (``torch.half``) and calls of poptorch_lite classes with such
    arguments, including chained setters
    (``poptorch.TensorLocationSettings().useOnChipStorage(False)``).
    """

    def __init__(self, options: Options):
        self._options = options

    def apply(self, node: ast.AST) -> None:
        if not (isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)):
            raise ValueError("expected a setter call such as "
                             "deviceIterations(4).")
        path = self._dotted(node.func)
        if not path.startswith("options."):
            raise ValueError("expected a setter call such as "
                             "deviceIterations(4).")
        setter = _setter(self._options, path[len("options."):])
        setter(*[self._value(a) for a in node.args],
               **{k.arg: self._value(k.value)
                  for k in node.keywords})

    @staticmethod
    def _dotted(node: ast.AST) -> str:
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            raise ValueError("only dotted names can be called here.")
        names.append(node.id)
        return ".".join(reversed(names))

    @staticmethod
    def _named(path: str):
        member = _enum_member(path)
        if member is not None:
            return member
        parts = path.split(".")
        if parts[0] == "torch" and len(parts) == 2 and isinstance(
                getattr(torch, parts[1], None), torch.dtype):
            return getattr(torch, parts[1])
        if parts[0] in ("poptorch", "poptorch_lite"):
            parts = parts[1:]
        if len(parts) == 1 and not parts[0].startswith("_"):
            for module in (enums, sys.modules[__name__], strategies):
                found = getattr(module, parts[0], None)
                if isinstance(found, type):
                    return found
        raise ValueError(f"unknown name {path!r}.")

    def _value(self, node: ast.AST):
        if isinstance(node, (ast.Name, ast.Attribute)):
            return self._named(self._dotted(node))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and not isinstance(
                    node.func.value, (ast.Name, ast.Attribute)):
                target = self._value(node.func.value)
                if node.func.attr.startswith("_"):
                    raise ValueError(f"cannot call {node.func.attr!r}.")
                function = getattr(target, node.func.attr)
            else:
                function = self._value(node.func)
                if not isinstance(function, type):
                    raise ValueError("only poptorch_lite classes can be "
                                     "called here.")
            return function(*[self._value(a) for a in node.args],
                            **{k.arg: self._value(k.value)
                               for k in node.keywords})
        try:
            return ast.literal_eval(node)
        except ValueError:
            raise ValueError(f"unsupported argument "
                             f"{ast.unparse(node)!r}: use literals, enum "
                             f"members or poptorch_lite classes.") from None
