"""Host I/O through IO tiles: PopTorch's `numIOTiles` and overlapped inputs and outputs.

`Options.TensorLocations.numIOTiles(n)` sets n tiles of every IPU aside for host transfers
(`ipusim.Target.with_io_tiles`): every op plans on the tiles that remain, so compute takes longer
in exchange for transfers that can overlap it. An input marked by `set_overlap_for_input` (mode
other than `NoOverlap`) streams from the host into a buffer on the IO tiles, in a program of its
own run before its stage program (the "prefetch"), and the stage program starts by exchanging it
to the compute tiles; an output marked by `set_overlap_for_output` is exchanged to an IO-tile
buffer at the end of its outputs program and streams to the host from there (the "drain"). The
runtime (`runtime/overlap.py`) lets those streams run during the neighbouring step, as the mode
allows. PopTorch's rules: overlapped I/O needs IO tiles and an execution strategy other than
PipelinedExecution.
"""
from __future__ import annotations

import ipusim as ip

from ..api.enums import OverlapMode
from ..api.errors import Error


def overlapped(mode) -> bool:
    return mode is not None and mode != OverlapMode.NoOverlap


def check_host_io(ir, placement, options) -> None:
    """PopTorch's errors for overlapped I/O the options cannot give."""
    if not any(overlapped(m) for m in ir.host_io.values()):
        return
    if placement.schedule_kind == "pipelined":
        raise Error("Overlapped IO is not supported with poptorch.PipelinedExecution. If you are using only one IPU, "
                    "please switch to poptorch.ShardedExecution.")
    if not options.TensorLocations.num_io_tiles:
        raise Error("No IO tiles allocated. You must allocate at least 32 IO tiles using "
                    "poptorch.Options().TensorLocations.numIOTiles.")


def device_target(target: ip.Target, options) -> ip.Target:
    """The target the model compiles for: with `numIOTiles` set, that many tiles are IO tiles."""
    io = options.TensorLocations.num_io_tiles
    if not io:
        return target
    if io >= target.total_tiles:
        raise Error(f"Options.TensorLocations.numIOTiles({io}) leaves no compute tiles on {target.name}, which has "
                    f"{target.total_tiles} tiles per IPU")
    return target.with_io_tiles(io)


def io_buffer(graph: ip.Graph, dtype, shape, name: str) -> ip.Tensor:
    """A host transfer's buffer spread over the IPU's IO tiles."""
    t = graph.addVariable(dtype, shape, name, category="host_io", always_live=True)
    graph.map_linearly(t, grain=4, min_elements_per_tile=64, tiles=graph.io_tiles)
    return t
