"""PopTorch's optimisers (`poptorch.optim`): torch optimisers (they also step on the CPU) that
accept PopTorch's extra arguments (`loss_scaling`, `accum_type`, ...). The compiler turns each
parameter group into a device optimiser (`poptorch_lite.compiler.updates`)."""
from __future__ import annotations

import torch

from ipusim.ops import optim as dev

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


def accumulator_dtype(group: dict) -> str:
    """PopTorch's `accum_type`: the dtype gradients are accumulated in (float32 unless given, for
    float16 weights too)."""
    return dtype_name(group.get("accum_type"), "accum_type")


def mean_reduction_strategy(options, optimizer, training: bool):
    """The MeanReductionStrategy a model runs with: the one set in `options`, else PopTorch's
    choice: ``Running`` when training accumulates in float16 (``accum_type=torch.float16``) without
    SGD's combined accumulator, ``Post`` otherwise."""
    from .enums import MeanReductionStrategy
    chosen = options.Training.mean_accumulation_and_replication_reduction_strategy
    if chosen is not None:
        return chosen
    if not training or optimizer is None:
        return MeanReductionStrategy.Post
    half = any(g.get("accum_type") == torch.float16 for g in optimizer.param_groups)
    combined = bool(optimizer.defaults.get("use_combined_accum"))
    return MeanReductionStrategy.Running if half and not combined else MeanReductionStrategy.Post


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


class Optimizer:
    """The base of PopTorch's optimisers (`isinstance(opt, poptorch.optim.Optimizer)`): records
    PopTorch's extra arguments on every parameter group, and which attributes are variable."""

    def _poptorch_defaults(self, loss_scaling, accum_type, **extra):
        if loss_scaling is not None and not loss_scaling > 0:
            raise ValueError(f"loss_scaling must be > 0, got {loss_scaling}")
        given = {k for k, v in (("loss_scaling", loss_scaling), ("accum_type", accum_type), *extra.items())
                 if v is not None}
        self.defaults.setdefault("loss_scaling", 1.0 if loss_scaling is None else float(loss_scaling))
        self.defaults.setdefault("accum_type", accum_type)
        for k, v in extra.items():
            self.defaults.setdefault(k, v)
        for group in self.param_groups:
            for k in ("loss_scaling", "accum_type", *extra):
                group.setdefault(k, self.defaults[k])
        poptorch_keys = {"loss_scaling", "accum_type", *extra}
        variable = [k for k, v in self.defaults.items() if k in given or (k not in poptorch_keys and v is not None)]
        self.variable_attrs = VariableAttributes(variable, list(self.defaults))


class SGD(Optimizer, torch.optim.SGD):
    def __init__(self, params, lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 maximize=False, foreach=None, differentiable=False, loss_scaling=None, velocity_scaling=None,
                 use_combined_accum=None, accum_type=None, velocity_accum_type=None, max_grad_norm=None):
        if maximize:
            raise ValueError("SGD(maximize=True) is not supported on the IPU")
        torch.optim.SGD.__init__(self, params, lr=lr, momentum=momentum, dampening=dampening,
                                 weight_decay=weight_decay, nesterov=nesterov)
        self._poptorch_defaults(loss_scaling, accum_type, velocity_scaling=velocity_scaling,
                                velocity_accum_type=velocity_accum_type, max_grad_norm=max_grad_norm,
                                use_combined_accum=use_combined_accum)


class Adam(Optimizer, torch.optim.Adam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 loss_scaling=None, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None, max_grad_norm=None):
        if amsgrad or maximize:
            raise ValueError("Adam(amsgrad=True or maximize=True) is not supported on the IPU")
        torch.optim.Adam.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._poptorch_defaults(loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                max_grad_norm=max_grad_norm)


class AdamW(Optimizer, torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 loss_scaling=None, bias_correction=True, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None, max_grad_norm=None):
        if amsgrad or maximize:
            raise ValueError("AdamW(amsgrad=True or maximize=True) is not supported on the IPU")
        torch.optim.AdamW.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._poptorch_defaults(loss_scaling, accum_type, bias_correction=bias_correction,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                max_grad_norm=max_grad_norm)


class RMSprop(Optimizer, torch.optim.RMSprop):
    def __init__(self, params, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                 foreach=None, maximize=False, differentiable=False, capturable=False, loss_scaling=None,
                 accum_type=None, first_order_momentum_accum_type=None, second_order_momentum_accum_type=None):
        if maximize:
            raise ValueError("RMSprop(maximize=True) is not supported on the IPU")
        torch.optim.RMSprop.__init__(self, params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                     momentum=momentum, centered=centered)
        self._poptorch_defaults(loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type)


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al. 2019) with PopTorch's options."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, bias_correction=True,
                 loss_scaling=None, max_weight_norm=None, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None):
        dev.LAMB(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_weight_norm=max_weight_norm)  # validates
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                          bias_correction=bias_correction,
                                                          max_weight_norm=max_weight_norm))
        self._poptorch_defaults(loss_scaling, accum_type,
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
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                d = p.grad / group["loss_scaling"]
                st["exp_avg"].mul_(b1).add_(d, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(d, d, value=1 - b2)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if group["bias_correction"]:
                    m = m / (1 - b1 ** st["step"])
                    v = v / (1 - b2 ** st["step"])
                u = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                r1 = p.norm()
                if group["max_weight_norm"] is not None:
                    r1 = r1.clamp(max=group["max_weight_norm"])
                r2 = u.norm()
                ratio = r1 / r2 if r1 > 0 and r2 > 0 else torch.tensor(1.0)
                p.sub_(group["lr"] * ratio * u)
        return loss


