"""Execution schedules as plain data: which IPU runs which op of which micro-batch at each step.

Pure functions turn an execution strategy's parameters into a `Schedule`; the runtime executes
its steps in order (the ops of one step run concurrently, at most one per IPU), the profiler
reads the same tables and `pricing` times them with per-stage costs. PopTorch's strategies are
in `poptorch`, the training schedules of the literature (GPipe, 1F1B, interleaved 1F1B, ZB-H1,
ZB-H2) in `orders`. See docs/schedules.md for the rules, the closed forms and the figures.
"""
from .core import KINDS, Op, OrderError, Schedule, Step, dependencies
from .orders import (TRAINING_KINDS, gpipe_schedule, interleaved_1f1b_schedule, one_f_one_b_schedule,
                     steps_from_orders, zb_h1_schedule, zb_h2_schedule)
from .pricing import Costs, Price, StageCosts, Timing, price
from .poptorch import (PIPELINE_KINDS, parallel_phased_schedule, pipelined_schedule, serial_phased_schedule,
                       sharded_schedule)

__all__ = ["KINDS", "Op", "OrderError", "Schedule", "Step", "dependencies", "TRAINING_KINDS", "gpipe_schedule",
           "interleaved_1f1b_schedule", "one_f_one_b_schedule", "steps_from_orders", "zb_h1_schedule",
           "zb_h2_schedule", "PIPELINE_KINDS", "parallel_phased_schedule", "pipelined_schedule",
           "serial_phased_schedule", "sharded_schedule", "Costs", "Price", "StageCosts", "Timing", "price"]
