"""`poptorch.CPU`: a Python function called from inside a model, on the host, as PopTorch's CPU ops.

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = poptorch.CPU(self.on_host, "MyCPUOp")

        def on_host(self, x):
            return x * 2.0

        def forward(self, x):
            return self.cpu(x) + 1

Inside a model the call is one op (`poptorch_lite::cpu_op`, compiler/library.py): its inputs leave
the device by device-to-host streams, the host runs the function on them (CPU tensors, in the
dtypes the model gave them) and its results come back by host-to-device streams into the tensors
the rest of the graph uses. The op is priced as those streams are: PCIe time and the host link's
latency each way, in the cycles and the timeline of the stage that calls it. Output shapes and
dtypes are found once, when the model is compiled, by calling the function on zeros shaped like
the inputs (as PopTorch does); every run calls it on the device's values. As in PopTorch, CPU ops
serve inference: a CPU op on the path of a training model's gradient is an error, and a module
given as the function has its parameters frozen. Outside a model the call simply calls the
function.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import handle_torch_function, has_torch_function

from .errors import Error


@dataclass(frozen=True)
class CpuCall:
    """One use of a CPU op as the capture saw it."""
    op: "CPU"
    inputs: tuple          # ((shape, torch dtype), ...)
    outputs: tuple         # ((shape, torch dtype), ...)
    single: bool           # the function returned one tensor (not a tuple or list)

    def run(self, arrays) -> list:
        """Call the function on the host: NumPy arrays in (the device's dtypes), arrays out in
        the output dtypes the compiler recorded."""
        tensors = [torch.from_numpy(a.copy()).reshape(shape).to(dtype)
                   for a, (shape, dtype) in zip(arrays, self.inputs)]
        with torch.no_grad():
            out = self.op._layer_to_call(*tensors)
        outs = [out] if not isinstance(out, (tuple, list)) else list(out)
        if len(outs) != len(self.outputs) or any(tuple(o.shape) != tuple(s) for o, (s, _) in zip(outs, self.outputs)):
            got = [tuple(o.shape) for o in outs]
            raise Error(f"CPU op {self.op.ID!r} returned results of shapes {got} at run time, but "
                        f"{[tuple(s) for s, _ in self.outputs]} when the model was compiled: a CPU op's "
                        "results must keep their shapes")
        return [o.detach().cpu().numpy() for o in outs]


_CALLS: dict[str, CpuCall] = {}
_LOCK = threading.Lock()


def cpu_call(key: str) -> CpuCall:
    return _CALLS[key]


def cpu_op(inputs: list, key: str) -> list:
    """A captured call of a CPU op (the capture maps it to the library op poptorch_lite::cpu_op)."""
    raise Error("a CPU op's captured call runs only while a model is captured")


class CPU:
    """Run `layer_to_call` (a function or module) on the host in the middle of an inference model;
    `ID` names the op. Calling the object calls the function with the same arguments."""

    def __init__(self, layer_to_call: Callable, ID: str):
        if not callable(layer_to_call):
            raise TypeError(f"poptorch.CPU expects a function or module to call, got {layer_to_call!r}")
        if not isinstance(ID, str) or not ID:
            raise TypeError(f"poptorch.CPU expects a non-empty str ID, got {ID!r}")
        self._layer_to_call = layer_to_call
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self.ID = ID

    def __call__(self, *inputs):
        if not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError(f"CPU op {self.ID!r}: arguments must be tensors, got "
                            f"{[type(t).__name__ for t in inputs]}")
        if not has_torch_function(inputs):
            return self._layer_to_call(*inputs)
        outs, single = self._output_specs(inputs)
        call = CpuCall(self, tuple((tuple(t.shape), t.dtype) for t in inputs), outs, single)
        key = f"{self.ID}@{id(self):x}:{call.inputs}"
        with _LOCK:
            _CALLS[key] = call
        results = handle_torch_function(cpu_op, inputs, list(inputs), key)
        return results[0] if single else tuple(results)

    def _output_specs(self, inputs) -> tuple[tuple, bool]:
        """The function's output shapes and dtypes, from a call on zeros outside the capture."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
        with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C.DisableTorchFunction(), \
                torch.no_grad():
            out = self._layer_to_call(*[torch.zeros(tuple(t.shape), dtype=t.dtype) for t in inputs])
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            raise Error(f"CPU op {self.ID!r} must return a tensor or a tuple or list of tensors, got "
                        f"{type(out).__name__}")
        return tuple((tuple(o.shape), o.dtype) for o in outs), single

    def __repr__(self):
        return f"CPU({self._layer_to_call!r}, {self.ID!r})"
