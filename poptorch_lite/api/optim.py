"""PopTorch's optimisers (`poptorch.optim`): torch optimisers (they also step on the CPU) that
accept PopTorch's extra arguments (`loss_scaling`, `accum_type`, ...). The compiler turns each
parameter group into a device optimiser (`poptorch_lite.compiler.updates`)."""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ipusim.ops import optim as dev

logger = logging.getLogger("poptorch_lite")

POPTORCH_EXTRAS = ("loss_scaling", "accum_type", "first_order_momentum_accum_type",
                   "second_order_momentum_accum_type", "velocity_scaling", "use_combined_accum",
                   "max_grad_norm", "max_weight_norm", "bias_correction")


def dtype_name(dtype, what: str) -> str:
    """The device dtype of one of PopTorch's accumulation types (None: float32)."""
    if dtype in (None, torch.float32):
        return "float32"
    if dtype == torch.float16:
        return "float16"
    raise ValueError(f"{what} must be torch.float32 or torch.float16, got {dtype}")


# Which of PopTorch's types each optimiser state slot is kept in: the first-order momentum (Adam's
# and LAMB's exp_avg, RMSprop's momentum buffer and centred gradient average), the second-order
# (exp_avg_sq, square_avg) and SGD's velocity. Each defaults to float32, whatever `accum_type`.
SLOT_TYPES = {"exp_avg": "first_order_momentum_accum_type", "grad_avg": "first_order_momentum_accum_type",
              "exp_avg_sq": "second_order_momentum_accum_type", "square_avg": "second_order_momentum_accum_type"}


def state_dtypes(group: dict, slots) -> dict[str, str]:
    """The dtype of each optimiser state slot of a parameter group, from PopTorch's types."""
    out = {}
    for slot in slots:
        if slot == "momentum_buffer":  # SGD's velocity, RMSprop's momentum buffer
            key = "velocity_accum_type" if "velocity_accum_type" in group else "first_order_momentum_accum_type"
        else:
            key = SLOT_TYPES[slot]
        out[slot] = dtype_name(group.get(key), key)
    return out


def accumulator_dtype(optimizer) -> str:
    """PopTorch's `accum_type`, an attribute of the whole optimiser: the dtype gradients are
    accumulated in (float32 unless given, for float16 weights too; torch's optimisers: float32)."""
    return dtype_name(getattr(optimizer, "accum_type", None), "accum_type")


def mean_reduction_strategy(options, optimizer, training: bool, compiled: bool = False):
    """The MeanReductionStrategy a model runs with, as PopTorch chooses it: ``Running`` when
    training accumulates in float16 (``accum_type=torch.float16``) without SGD's combined
    accumulator, whatever `options` set (a mean of float16 sums would overflow); else the one set
    in `options`, else ``Post``. A `compiled` model cannot change it: an optimiser needing
    ``Running`` when the model runs another strategy is refused."""
    from .enums import MeanReductionStrategy
    chosen = options.Training.mean_accumulation_and_replication_reduction_strategy
    half = training and optimizer is not None and accumulator_dtype(optimizer) == "float16"
    if half and not bool(optimizer.defaults.get("use_combined_accum")):
        if compiled and chosen != MeanReductionStrategy.Running:
            raise ValueError("Invalid optimizer: the new optimizer would require changing options.Training."
                             "meanAccumulationAndReplicationReductionStrategy to poptorch.MeanReductionStrategy."
                             "Running but the executable is already compiled.")
        return MeanReductionStrategy.Running
    return MeanReductionStrategy.Post if chosen is None else chosen


class VariableAttributes:
    """Which of an optimiser's attributes are variable (may change through `setOptimizer`) and
    which constant, as PopTorch tracks them (`optimizer.variable_attrs`): those given a value when
    the optimiser was made are variable, the others constant. On the emulator every hyperparameter
    is a device tensor whichever it is, so the marks change no value and no compile."""

    def __init__(self, variable_attributes, allowed_attributes):
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def _check(self, attr: str) -> None:
        if attr not in self._allowed_attributes:
            raise AssertionError(f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}")

    def isConstant(self, attr: str) -> bool:
        """True if `attr` is marked constant."""
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:
        """Mark `attr` constant."""
        self._check(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        """Mark `attr` variable."""
        self._check(attr)
        if attr not in self._variable_attributes:
            self._variable_attributes.append(attr)


def _given(arguments: dict) -> set:
    """The hyperparameters a constructor call gave (not None): PopTorch marks those variable
    (the learning rate always has a value)."""
    return {k for k, v in arguments.items() if v is not None and k not in ("self", "params", "__class__")}


def _or(value, default):
    return default if value is None else value


class Optimizer:
    """The base of PopTorch's optimisers (`isinstance(opt, poptorch.optim.Optimizer)`): records
    PopTorch's extra arguments on every parameter group, and which attributes are variable: those
    the constructor was given (not None), as in PopTorch."""

    def _poptorch_defaults(self, given: set, loss_scaling, accum_type, **extra):
        if loss_scaling is not None and not loss_scaling > 0:
            raise ValueError(f"loss_scaling must be > 0, got {loss_scaling}")
        # one value for the whole optimiser (not per group), as in PopTorch
        self.loss_scaling = 1.0 if loss_scaling is None else float(loss_scaling)
        dtype_name(accum_type, "accum_type")   # validates
        self.accum_type = accum_type   # the whole optimiser's, as in PopTorch
        for k, v in extra.items():
            self.defaults.setdefault(k, v)
        for group in self.param_groups:
            for k in extra:
                group.setdefault(k, self.defaults[k])
        self.variable_attrs = VariableAttributes([k for k in (*self.defaults, "loss_scaling") if k in given],
                                                 [*self.defaults, "loss_scaling"])

        # PopTorch's device state (`ipu_state`: the optimiser state tensors, `ipu_param`: the
        # variable hyperparameter tensors, both named as PopART names them); None until a model
        # compiled with this optimiser reads them. `ipu_state_is_dirty`: the host holds state the
        # device must be given; `host_state_is_dirty`: the device ran since the host last read it.
        self._state_dict = {"ipu_state": None, "ipu_param": None}
        self.ipu_state_is_dirty = False
        self.host_state_is_dirty = False

    def state_dict(self) -> dict:
        """torch's state dict with PopTorch's `ipu_state` and `ipu_param` (read from the device
        first when a training model uses this optimiser)."""
        return self.get_state_dict()

    def load_state_dict(self, state: dict) -> None:
        """torch's state (LR schedulers need it) and the device state: written to the device when
        a model next uses this optimiser."""
        torch.optim.Optimizer.load_state_dict(self, state)
        self.set_state_dict(state)

    def get_state_dict(self) -> dict:
        """The state dict as the host holds it (no device read)."""
        return {**self._state_dict, **torch.optim.Optimizer.state_dict(self)}

    def set_state_dict(self, state: dict) -> None:
        """Keep `state`'s device state to write to the device."""
        if not state:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not ("ipu_state" in state and "ipu_param" in state):
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        self._state_dict = state
        self.ipu_state_is_dirty = True
        self.host_state_is_dirty = False

    def has_state(self) -> bool:
        """Whether the host holds device state (read from a device or loaded)."""
        return self._state_dict.get("ipu_state") is not None and self._state_dict.get("ipu_param") is not None

    def __getstate__(self):
        # torch keeps defaults, state and groups; the optimiser-wide attributes come along, and
        # the device state, which a copy must write to its device
        return {**torch.optim.Optimizer.__getstate__(self), "loss_scaling": self.loss_scaling,
                "accum_type": self.accum_type, "variable_attrs": self.variable_attrs, "_state_dict": self._state_dict,
                "ipu_state_is_dirty": self.has_state(), "host_state_is_dirty": False}


def loss_scaling(optimizer) -> float:
    """An optimiser's loss scaling: PopTorch's optimiser attribute (1 for torch's optimisers)."""
    value = float(getattr(optimizer, "loss_scaling", 1.0))
    if not value > 0:
        raise ValueError(f"loss_scaling must be > 0, got {value}")
    return value


class SGD(Optimizer, torch.optim.SGD):
    def __init__(self, params, lr=0.01, momentum=None, dampening=None, weight_decay=None, nesterov=None,
                 maximize=None, foreach=None, differentiable=None, loss_scaling=None, velocity_scaling=None,
                 use_combined_accum=None, accum_type=None, velocity_accum_type=None, max_grad_norm=None):
        given = _given(locals())
        if maximize:
            raise ValueError("SGD(maximize=True) is not supported on the IPU")
        torch.optim.SGD.__init__(self, params, lr=lr, momentum=_or(momentum, 0.0), dampening=_or(dampening, 0.0),
                                 weight_decay=_or(weight_decay, 0.0), nesterov=_or(nesterov, False))
        # velocity scaling is a group value of the combined variant only; the separate variant
        # scales the velocity by the loss scaling
        scaling = {"velocity_scaling": 1.0 if velocity_scaling is None else float(velocity_scaling)} \
            if use_combined_accum else {}
        if velocity_scaling is not None and not use_combined_accum:
            logger.warning("velocity_scaling value ignored when using the separate variant (use_combined_accum="
                           "False): the velocity is scaled by the loss scaling")
        self._poptorch_defaults(given, loss_scaling, accum_type, **scaling,
                                velocity_accum_type=velocity_accum_type, max_grad_norm=max_grad_norm,
                                use_combined_accum=use_combined_accum)


class Adam(Optimizer, torch.optim.Adam):
    def __init__(self, params, lr=1e-3, betas=None, eps=None, weight_decay=None, amsgrad=None,
                 foreach=None, maximize=None, capturable=None, differentiable=None, fused=None,
                 loss_scaling=None, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None, max_grad_norm=None):
        given = _given(locals())
        if amsgrad or maximize:
            raise ValueError("Adam(amsgrad=True or maximize=True) is not supported on the IPU")
        torch.optim.Adam.__init__(self, params, lr=lr, betas=_or(betas, (0.9, 0.999)), eps=_or(eps, 1e-8),
                                  weight_decay=_or(weight_decay, 0.0))
        self._poptorch_defaults(given, loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                max_grad_norm=max_grad_norm)


class AdamW(Optimizer, torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=None, eps=None, weight_decay=None, amsgrad=None,
                 foreach=None, maximize=None, capturable=None, differentiable=None, fused=None,
                 loss_scaling=None, bias_correction=True, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None, max_grad_norm=None):
        given = _given(locals()) - {"bias_correction"}
        if amsgrad or maximize:
            raise ValueError("AdamW(amsgrad=True or maximize=True) is not supported on the IPU")
        torch.optim.AdamW.__init__(self, params, lr=lr, betas=_or(betas, (0.9, 0.999)), eps=_or(eps, 1e-8),
                                   weight_decay=_or(weight_decay, 1e-2))
        self._poptorch_defaults(given, loss_scaling, accum_type, bias_correction=bias_correction,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                max_grad_norm=max_grad_norm)

    @torch.no_grad()
    def step(self, closure=None):
        """torch's AdamW step; a group with `bias_correction=False` steps as the device does,
        without the moments' bias corrections (its gradients divided by the loss scaling)."""
        if all(g.get("bias_correction", True) for g in self.param_groups):
            return torch.optim.AdamW.step(self, closure)
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            corrected = group.get("bias_correction", True)
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m, v = _adam_moments(self.state[p], p, p.grad / self.loss_scaling, b1, b2, corrected, torch.tensor(0.0))
                p.sub_(group["lr"] * m / (v.sqrt() + group["eps"]))
        return loss


def _adam_moments(st: dict, p, d, b1: float, b2: float, corrected: bool, first_step):
    """One step of Adam's moments of gradient `d` in state `st` (made, with `first_step`, on the
    first step): the first and second moments, bias-corrected when `corrected`."""
    if not st:
        st["step"] = first_step
        st["exp_avg"] = torch.zeros_like(p)
        st["exp_avg_sq"] = torch.zeros_like(p)
    st["step"] += 1
    st["exp_avg"].mul_(b1).add_(d, alpha=1 - b1)
    st["exp_avg_sq"].mul_(b2).addcmul_(d, d, value=1 - b2)
    m, v = st["exp_avg"], st["exp_avg_sq"]
    if corrected:
        m = m / (1 - b1 ** st["step"])
        v = v / (1 - b2 ** st["step"])
    return m, v


class RMSprop(Optimizer, torch.optim.RMSprop):
    def __init__(self, params, lr=0.01, alpha=None, eps=None, weight_decay=None, momentum=None, centered=None,
                 foreach=None, maximize=None, differentiable=None, capturable=None, loss_scaling=None,
                 accum_type=None, first_order_momentum_accum_type=None, second_order_momentum_accum_type=None,
                 use_tf_variant=None):
        given = _given(locals())
        if maximize:
            raise ValueError("RMSprop(maximize=True) is not supported on the IPU")
        torch.optim.RMSprop.__init__(self, params, lr=lr, alpha=_or(alpha, 0.99), eps=_or(eps, 1e-8),
                                     weight_decay=_or(weight_decay, 0.0), momentum=_or(momentum, 0.0),
                                     centered=_or(centered, False))
        self._poptorch_defaults(given, loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                use_tf_variant=bool(use_tf_variant))


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al. 2019) with PopTorch's options."""

    def __init__(self, params, lr=1e-3, betas=None, eps=None, weight_decay=None, bias_correction=True,
                 loss_scaling=None, max_weight_norm=None, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None):
        given = _given(locals()) - {"bias_correction"}
        betas, eps, weight_decay = _or(betas, (0.9, 0.999)), _or(eps, 1e-8), _or(weight_decay, 1e-2)
        dev.LAMB(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_weight_norm=max_weight_norm)  # validates
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                          bias_correction=bias_correction,
                                                          max_weight_norm=max_weight_norm))
        self._poptorch_defaults(given, loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m, v = _adam_moments(self.state[p], p, p.grad / self.loss_scaling, b1, b2, group["bias_correction"], 0)
                u = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                r1 = p.norm()
                if group["max_weight_norm"] is not None:
                    r1 = r1.clamp(max=group["max_weight_norm"])
                r2 = u.norm()
                ratio = r1 / r2 if r1 > 0 and r2 > 0 else torch.tensor(1.0)
                p.sub_(group["lr"] * ratio * u)
        return loss


# --- what the device is told of an optimiser: PopTorch's description of it ------------------------
#
# PopTorch turns an optimiser into one set of hyperparameters for the graph (the defaults, named
# `default...`, with the loss scaling) and one per parameter group, each value marked constant or
# variable, and logs each at debug level when the device receives it ("Updating graph optimizer
# with ...", "Updating group N optimizer with ..."). Attributes it does not know are reported once.

# When no VariableAttributes say so (torch's optimisers), a value is constant when it has the
# value that makes it a no-op (torch's default); the learning rate is always variable.
_CONST_WHEN = {"lr": None, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "velocity_scaling": 1.0,
               "eps": 1e-08, "max_weight_norm": 65500.0, "alpha": "always", "nesterov": "always",
               "betas": "always", "loss_scaling": 1.0}
_TORCH = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)


def kind(optimizer) -> str:
    """PopTorch's name of the device optimiser `optimizer` becomes: SGD1 (combined accumulator),
    SGD2 (separate), ADAM, ADAMW, RMSPROP or LAMB."""
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD1" if optimizer.defaults.get("use_combined_accum") else "SGD2"
    if isinstance(optimizer, torch.optim.AdamW):
        return "ADAMW"
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "RMSPROP"
    if isinstance(optimizer, LAMB):
        return "LAMB"
    raise TypeError(f"optimizer {type(optimizer).__name__} is not supported: use SGD, Adam, AdamW, RMSprop "
                    "(torch.optim or poptorch.optim) or poptorch.optim.LAMB")


def _is_const(optimizer, name: str, value) -> bool:
    attrs = getattr(optimizer, "variable_attrs", None)
    if attrs is not None:
        return attrs.isConstant(name)
    rule = _CONST_WHEN[name]
    if name == "weight_decay" and isinstance(optimizer, torch.optim.AdamW):
        rule = 1e-2
    return rule == "always" or (rule is not None and value == rule)


def _group_values(optimizer, group: dict, sgd_separate_scale) -> dict:
    """One group's (or the defaults') hyperparameters: PopTorch name -> (value, constant)."""
    k = kind(optimizer)
    out = {}

    def put(popart_name, torch_name, value):
        out[popart_name] = (float(value), _is_const(optimizer, torch_name, value))

    put("learningRate", "lr", group["lr"])
    put("weightDecay", "weight_decay", group.get("weight_decay", 0.0))
    if k.startswith("SGD"):
        put("momentum", "momentum", group.get("momentum", 0.0))
        put("dampening", "dampening", group.get("dampening", 0.0))
        put("nesterov", "nesterov", bool(group.get("nesterov", False)))
        if sgd_separate_scale is None:
            put("velocityScaling", "velocity_scaling", group.get("velocity_scaling") or 1.0)
        else:   # the separate variant scales its velocity by the loss scaling
            out["velocityScaling"] = sgd_separate_scale
    elif k == "RMSPROP":
        put("alpha", "alpha", group["alpha"])
        put("momentum", "momentum", group.get("momentum", 0.0))
        put("eps", "eps", group["eps"])
    else:
        b1, b2 = group["betas"]
        const = _is_const(optimizer, "betas", group["betas"])
        out["beta1"], out["beta2"] = (float(b1), const), (float(b2), const)
        put("eps", "eps", group["eps"])
        if k == "LAMB":
            norm = group.get("max_weight_norm")
            put("maxWeightNorm", "max_weight_norm", 65500.0 if norm is None else norm)
    return out


def _dtype_text(dtype) -> str:
    return "float16" if dtype == torch.float16 else "float32"


def describe(optimizer) -> tuple:
    """PopTorch's description of `optimizer` as the device gets it: (graph line, group lines).
    Values print as C++ prints a float; `(const)` marks a constant."""
    k = kind(optimizer)
    d = optimizer.defaults
    scale = loss_scaling(optimizer)
    loss = (scale, _is_const(optimizer, "loss_scaling", scale))
    separate = loss if k == "SGD2" else None
    first = "velocity_accum_type" if k.startswith("SGD") else "first_order_momentum_accum_type"
    second = None if k.startswith("SGD") else d.get("second_order_momentum_accum_type")
    tail = (f", accumType={_dtype_text(getattr(optimizer, 'accum_type', None))}"
            f", firstOrderMomentumAccumType={_dtype_text(d.get(first))}"
            f", secondOrderMomentumAccumType={_dtype_text(second)}"
            f", useTfVariant={int(bool(d.get('use_tf_variant', False)))}"
            f", maxGradNorm={_float_text(d.get('max_grad_norm') or math.inf)}")

    def line(values: dict) -> str:
        text = "".join(f", {n}={_float_text(v)}{' (const)' if c else ''}" for n, (v, c) in sorted(values.items()))
        return k + text + tail

    # the defaults' per-group names take PopTorch's `default` prefix (not nesterov)
    defaults = {(n if n == "nesterov" else "default" + n[0].upper() + n[1:]): v
                for n, v in _group_values(optimizer, d, separate).items()}
    defaults["lossScaling"] = loss
    groups = [line(_group_values(optimizer, g, separate)) for g in optimizer.param_groups]
    return line(defaults), groups


def _float_text(value: float) -> str:
    """A float32 as C++'s stream prints it (six significant digits)."""
    v = float(np.float32(value))
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:g}"


class OptimizerUpdates:
    """A training model's record of what its device was told of the optimiser: warns (once) when
    an optimiser is a subclass PopTorch would not run the Python code of, and about attributes
    added after the first optimiser was seen (PopTorch ignores them; debug level with
    `Options.relaxOptimizerAttributesChecks`), and logs the hyperparameters the device receives
    when they change."""

    _HIDDEN = ("defaults", "state", "param_groups", "variable_attrs")

    def __init__(self, relaxed: bool):
        self._log = logger.debug if relaxed else logger.warning
        self._known: dict[str, list] = {"group": [], "optimizer": []}
        self._recording = True
        self._printed: set[str] = set()
        self._sent = None

    def convert(self, optimizer) -> tuple:
        """Check `optimizer` as PopTorch does when it is given to the model; its description."""
        k = kind(optimizer)
        bases = type(optimizer).__bases__
        if type(optimizer) not in _TORCH and torch.optim.Optimizer not in bases and Optimizer not in bases:
            logger.warning("Optimizer `%s` subclassed from classes in poptorch.optim or torch.optim are unlikely "
                           "to behave as intended. Poptorch does not run Python optimizer code directly; but "
                           "instead uses IPU native optimisers.", type(optimizer).__name__)
        self._check("group", list(optimizer.defaults), "default group variable", k)
        self._check("optimizer", [a for a in vars(optimizer) if a not in self._HIDDEN and not a.startswith("_")
                                  and a != "state_dict"], "optimizer attribute", k)
        for i, group in enumerate(optimizer.param_groups):
            self._check("group", [a for a in group if a != "params"], f"group {i} attribute", k)
        self._recording = False
        return describe(optimizer)

    def _check(self, key: str, provided: list, what: str, k: str) -> None:
        extra = [a for a in provided if a not in self._known[key]]
        if self._recording:
            self._known[key] += extra
        elif extra:
            message = f"Ignoring unexpected {what} in {k} optimizer: {extra}"
            if message not in self._printed:
                self._printed.add(message)
                self._log(message)

    def send(self, description: tuple) -> None:
        """The device receives `description` (from `convert`): log it if it changed."""
        if description == self._sent:
            return
        self._sent = description
        graph, groups = description
        logger.debug("Updating graph optimizer with %s", graph)
        for i, text in enumerate(groups):
            logger.debug("Updating group %d optimizer with %s", i, text)


# --- the optimiser's device tensors as PopTorch's state dict names them ---------------------------
#
# `optimizer.state_dict()` of a poptorch.optim optimiser holds, besides torch's state, `ipu_state`
# (the optimiser state tensors the device keeps per weight) and `ipu_param` (the host copies of
# the hyperparameter tensors PopTorch streams to the device: the variable ones only, constants
# being part of the program). Both are named as PopART names them: a prefix, then the weight.

# the state slot -> PopART's tensor prefix, per device optimiser
# (the count of updates applied, wherever the device keeps one, is `Step___`)
_STATE_PREFIX = {
    "SGD1": {"momentum_buffer": "Accl___", "step": "Step___"},
    "SGD2": {"momentum_buffer": "Accl1___", "step": "Step___"},
    "ADAM": {"exp_avg": "Accl1___", "exp_avg_sq": "Accl2___", "step": "Step___"},
    "RMSPROP": {"square_avg": "Accl1___", "grad_avg": "Accl2___", "momentum_buffer": "Accl3___", "step": "Step___"},
}
_STATE_PREFIX["ADAMW"] = _STATE_PREFIX["LAMB"] = _STATE_PREFIX["ADAM"]


def state_tensor_name(optimizer, slot: str, weight: str) -> str:
    """PopART's name of optimiser state `slot` (torch's name: exp_avg, step, ...) of `weight`."""
    return _STATE_PREFIX[kind(optimizer)][slot] + weight


def state_slot(optimizer, name: str) -> tuple[str, str] | None:
    """(slot, weight) of a PopART state tensor name of `optimizer`'s kind; None if not one."""
    for slot, prefix in _STATE_PREFIX[kind(optimizer)].items():
        if name.startswith(prefix):
            return slot, name[len(prefix):]
    return None


def _sgd_without_momentum(optimizer) -> bool:
    """PopART's SGD0: no group has a momentum and none may get one (momentum constant)."""
    return all(g.get("momentum", 0.0) == 0.0 for g in optimizer.param_groups) and \
        _is_const(optimizer, "momentum", 0.0)


def hyperparameter_tensors(optimizer, trained: dict[int, tuple[str, torch.dtype]], replicas: int = 1) -> dict:
    """The variable hyperparameter tensors of `optimizer` for the model's trained parameters
    (`trained`: id of the parameter -> its name and dtype), as PopART names them (`<hyperparameter>___specific___<weight>`, the loss
    scaling `lossScaling_FLOAT`): scalars holding what the device is given. SGD's are PopART's
    compound values (e.g. scaledLearningRate0 = lr (1 - dampening) / loss scaling)."""
    k = kind(optimizer)
    ls = loss_scaling(optimizer)
    ls_var = not _is_const(optimizer, "loss_scaling", ls)
    out: dict[str, torch.Tensor] = {}
    if ls_var:
        out["lossScaling_FLOAT"] = torch.tensor(ls, dtype=torch.float32)
    sgd0 = k.startswith("SGD") and _sgd_without_momentum(optimizer)
    for group in optimizer.param_groups:
        def var(attr):
            return not _is_const(optimizer, attr, group.get(attr))
        lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
        values = []   # (prefix, value, variable, in the weight's dtype)
        if sgd0:
            dm = float(group.get("dampening", 0.0))
            values += [("scaledLearningRate0", lr * (1 - dm) / ls, var("lr") or var("dampening") or ls_var, False),
                       ("weightDecayScaleFactor0", 1 - lr * (1 - dm) * wd,
                        var("weight_decay") or (wd != 0 and (var("lr") or var("dampening"))), True)]
        elif k.startswith("SGD"):
            dm, mm = float(group.get("dampening", 0.0)), float(group.get("momentum", 0.0))
            # the separate variant scales its velocity by the loss scaling
            vs, vs_var = (float(group.get("velocity_scaling") or 1.0), var("velocity_scaling")) if k == "SGD1" \
                else (ls, ls_var)
            values += [("scaledWeightDecay1", (1 - dm) * wd * vs, var("dampening") or var("weight_decay") or vs_var,
                        True),
                       ("scaledLearningRate1", lr / (vs * replicas), var("lr") or vs_var, False),
                       ("dampeningScaleFactor1", (1 - dm) * vs * replicas / ls, var("dampening") or vs_var or ls_var,
                        False),
                       ("scaledMomentum1", mm / replicas, var("momentum"), False)]
        else:
            values += [("learningRate", lr, var("lr"), False), ("weightDecay", wd, var("weight_decay"), False)]
            if k == "RMSPROP":
                values += [("adaptiveAlpha", group["alpha"], var("alpha"), False),
                           ("adaptiveMomentum", group.get("momentum", 0.0), var("momentum"), False),
                           ("adaptiveEps", group["eps"], var("eps"), False)]
            else:
                b1, b2 = group["betas"]
                values += [("adamBeta1", b1, var("betas"), False), ("adamBeta2", b2, var("betas"), False),
                           ("adamEps", group["eps"], var("eps"), False)]
                if k == "LAMB":
                    norm = group.get("max_weight_norm")
                    values.append(("maxWeightNorm", 65500.0 if norm is None else norm, var("max_weight_norm"),
                                   False))
            values.append(("lossScaling", ls, ls_var, False))
        for p in group["params"]:
            if id(p) not in trained:
                continue
            name, dtype = trained[id(p)]
            for prefix, value, variable, own_dtype in values:
                if variable:
                    out[f"{prefix}___specific___{name}"] = torch.tensor(
                        float(value), dtype=dtype if own_dtype else torch.float32)
    return out
