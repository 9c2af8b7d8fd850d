"""Batching rules of a model call, as PopTorch and PopART define them.

One call of a model consumes ``micro_batch_size * deviceIterations *
replicationFactor * gradientAccumulation`` samples (inference models do not
accumulate gradients, so the last factor is 1 for them). Sample ``i`` of the
call goes to device iteration ``i // (G*R*M)``, accumulation step
``(i // (R*M)) % G``, replica ``(i // M) % R`` (PopART's input layout
``[deviceIterations, gradientAccumulation, replicationFactor, micro_batch]``).

The ``OutputMode`` decides which micro-batch results a call returns, in the
same layout: ``All`` every one, ``EveryN`` those of every N-th device
iteration, ``Final`` the last one, ``Sum`` their sum, each per replica.
"""
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import torch

from . import strategies
from .enums import OutputMode
from .errors import Error
from .options import Options


class BatchSizeError(Error, ValueError):
    """A model call's batch dimension does not fit the batching options, or
    the options do not fit the model (gradient accumulation in inference)."""


def batch_factors(options: Options, training: bool) -> Tuple[int, int, int]:
    """``(deviceIterations, replicationFactor, gradientAccumulation)`` of a
    call; gradient accumulation counts as 1 for inference."""
    accumulation = options.gradient_accumulation if training else 1
    return options.device_iterations, options.replication_factor, accumulation


def input_factors(options: Options, training: bool) -> Tuple[int, int, int]:
    """``(deviceIterations, input groups, gradientAccumulation)``: how many
    different micro-batches of each input a call feeds (replicas of one input
    replica group get the same ones: ``Options.inputReplicaGrouping``)."""
    device_iterations, _, accumulation = batch_factors(options, training)
    return device_iterations, options.input_groups, accumulation


def combined_batch_size(micro_batch_size: int, options: Options,
                        training: bool) -> int:
    """Samples one model call consumes."""
    device_iterations, replicas, accumulation = input_factors(options, training)
    return micro_batch_size * device_iterations * replicas * accumulation


@dataclass(frozen=True)
class BatchPlan:
    """How the batch of one model call splits into micro-batches."""
    micro_batch_size: int
    device_iterations: int
    replication_factor: int
    gradient_accumulation: int

    @property
    def combined_batch_size(self) -> int:
        """Samples per call."""
        return (self.micro_batch_size * self.device_iterations *
                self.replication_factor * self.gradient_accumulation)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per call, over all replicas."""
        return (self.device_iterations * self.replication_factor *
                self.gradient_accumulation)


def _batch_dimension(batch) -> Tuple[int, str]:
    shape = getattr(batch, "shape", None)
    if shape is None:
        return int(batch), ""
    shape = tuple(shape)
    return (shape[0] if shape else 1), f" (shape {list(shape)})"


def split_call_batch(batch,
                     options: Options,
                     training: bool,
                     micro_batch_size: Optional[int] = None,
                     input_name: str = "input") -> BatchPlan:
    """Check a call's batch dimension and split it into micro-batches.

    ``batch`` is the batch size or a tensor whose leading dimension is the
    batch (a 0-d tensor counts as a batch of 1). Without ``micro_batch_size``
    (the first call, which fixes it) the batch must be a positive multiple of
    ``deviceIterations * replicationFactor * gradientAccumulation``; with it,
    the batch must equal the combined batch size exactly.
    """
    size, shape = _batch_dimension(batch)
    device_iterations, replicas, accumulation = input_factors(options, training)
    per_micro_sample = device_iterations * replicas * accumulation
    grouped = (f" / inputReplicaGrouping's group size ({options.input_group_size})"
               if options.input_group_size > 1 else "")
    factors = (f"deviceIterations ({device_iterations}) x replicationFactor "
               f"({options.replication_factor}){grouped} x gradientAccumulation ({accumulation}"
               f"{'' if training else ', always 1 for inference'})")
    if micro_batch_size is None:
        if size < per_micro_sample or size % per_micro_sample:
            raise BatchSizeError(
                f"Invalid batch dimension {size} for {input_name}{shape}: a "
                f"model call consumes micro_batch_size x {factors} samples, "
                f"so the batch dimension must be a positive multiple of "
                f"{per_micro_sample}. Pass batches of micro_batch_size * "
                f"{per_micro_sample} samples (poptorch_lite.DataLoader does "
                f"this for you) or change these options.")
        micro_batch_size = size // per_micro_sample
    elif size != micro_batch_size * per_micro_sample:
        raise BatchSizeError(
            f"Invalid batch dimension {size} for {input_name}{shape}: the "
            f"model was compiled for micro_batch_size ({micro_batch_size}) x "
            f"{factors} = {micro_batch_size * per_micro_sample} samples per "
            f"call. Pass batches of that size (poptorch_lite.DataLoader with "
            f"batch_size={micro_batch_size} does this for you).")
    return BatchPlan(micro_batch_size, device_iterations, replicas,
                     accumulation)


def device_layout(tensor, plan: BatchPlan):
    """View a call's input as ``[deviceIterations, gradientAccumulation,
    replicationFactor, micro_batch, *sample_shape]`` (torch or NumPy)."""
    shape = tuple(tensor.shape)
    if not shape or shape[0] != plan.combined_batch_size:
        raise BatchSizeError(f"device_layout needs a leading dimension of "
                             f"{plan.combined_batch_size}, got shape "
                             f"{list(shape)}.")
    return tensor.reshape(plan.device_iterations, plan.gradient_accumulation,
                          plan.replication_factor, plan.micro_batch_size,
                          *shape[1:])


def check_inference_options(options: Options) -> None:
    """Refuse gradient accumulation in an inference model, as PopTorch does."""
    accumulation = options.gradient_accumulation
    if accumulation == 1:
        return
    message = (f"An inference model needs Options.Training."
               f"gradientAccumulation(1) (the default), got "
               f"{accumulation}: only training accumulates gradients.")
    strategy = options.execution_strategy
    if isinstance(strategy, strategies.PipelinedExecution) and not isinstance(strategy, strategies.ShardedExecution):
        message += (" To keep an inference pipeline busy, use "
                    "Options.deviceIterations(n) instead.")
    raise BatchSizeError(message)


def resolve_output_mode(options: Options, training: bool) -> OutputMode:
    """``OutputMode.Default`` is ``Final`` for training, ``All`` for
    inference; other modes are kept."""
    if options.output_mode == OutputMode.Default:
        return OutputMode.Final if training else OutputMode.All
    return options.output_mode


@dataclass(frozen=True)
class OutputPlan:
    """Which micro-batch results one call returns (per replica)."""
    mode: OutputMode
    device_iterations: int
    gradient_accumulation: int
    replication_factor: int
    return_period: int

    @property
    def returned_steps(self) -> Tuple[Tuple[int, int], ...]:
        """``(device_iteration, accumulation_step)`` of every result returned
        per replica, in output order (``Sum`` adds them all up)."""
        steps = range(self.gradient_accumulation)
        if self.mode == OutputMode.Final:
            return ((self.device_iterations - 1,
                     self.gradient_accumulation - 1), )
        if self.mode == OutputMode.EveryN:
            iterations = range(self.return_period - 1, self.device_iterations,
                               self.return_period)
        else:
            iterations = range(self.device_iterations)
        return tuple((i, s) for i in iterations for s in steps)

    @property
    def multiplier(self) -> int:
        """How many micro-batch results the output holds (1 keeps the
        micro-batch shape: a scalar loss stays a scalar)."""
        if self.mode == OutputMode.Sum:
            return self.replication_factor
        return len(self.returned_steps) * self.replication_factor

    def output_shape(self, micro_batch_shape: Sequence[int]) -> Tuple[int, ...]:
        """Shape of an output whose per-micro-batch shape is given."""
        shape = tuple(micro_batch_shape)
        if self.multiplier == 1:
            return shape
        if not shape:
            return (self.multiplier, )
        return (self.multiplier * shape[0], *shape[1:])

    def gather(self, results: Mapping[Tuple[int, int, int], torch.Tensor]
               ) -> torch.Tensor:
        """Assemble one output from per-micro-batch results keyed by
        ``(device_iteration, accumulation_step, replica)``."""
        replicas = range(self.replication_factor)
        if self.mode == OutputMode.Sum:
            parts = [
                torch.stack([results[(i, s, r)]
                             for i, s in self.returned_steps]).sum(dim=0)
                for r in replicas
            ]
        else:
            parts = [
                results[(i, s, r)] for i, s in self.returned_steps
                for r in replicas
            ]
        if len(parts) == 1:
            return parts[0]
        if parts[0].dim() == 0:
            return torch.stack(parts)
        return torch.cat(parts)


def output_plan(options: Options, training: bool) -> OutputPlan:
    """The ``OutputPlan`` of a model call; ``EveryN``'s period must divide
    ``deviceIterations`` (PopART's rule)."""
    mode = resolve_output_mode(options, training)
    device_iterations, replicas, accumulation = batch_factors(options, training)
    period = options.output_return_period
    if mode == OutputMode.EveryN and (period > device_iterations
                                      or device_iterations % period):
        raise ValueError(
            f"OutputMode.EveryN returns the results of every N-th device "
            f"iteration, so N ({period}) must divide Options.deviceIterations "
            f"({device_iterations}). Pick a period that divides it or change "
            f"deviceIterations.")
    return OutputPlan(mode, device_iterations, accumulation, replicas, period)


def output_multiplier(options: Options, training: bool) -> int:
    """Micro-batch results per output: ``All``: R*D*G, ``EveryN``: R*D*G/N,
    ``Final`` and ``Sum``: R (G is 1 for inference)."""
    return output_plan(options, training).multiplier
