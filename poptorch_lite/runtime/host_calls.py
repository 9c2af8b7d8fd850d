"""The host's end of poptorch.CPU ops: a model run hands a CPU op's inputs to the host by streams,
and takes its results back by others (compiler/lowering.py: HostCallSite)."""
from __future__ import annotations

import numpy as np


class HostCall:
    """One CPU op of one replica: collects the inputs its device-to-host streams deliver and, when
    the first result is asked for, calls the function on them once."""

    def __init__(self, site):
        self.site = site
        self.inputs: list = [None] * len(site.to_host)
        self.results: list | None = None

    def receiver(self, i: int):
        def receive(value: np.ndarray) -> None:
            self.inputs[i] = value
            self.results = None  # new inputs: the next result request calls the function again
        return receive

    def sender(self, j: int):
        def send() -> np.ndarray:
            if self.results is None:
                self.results = self.site.call.run(self.inputs)
            return self.results[j]
        return send


def connect(engine, sites) -> None:
    """Connect the streams of every CPU op of a lowering to its host end."""
    for site in sites:
        host = HostCall(site)
        for i, name in enumerate(site.to_host):
            engine.connectStream(name, host.receiver(i))
        for j, name in enumerate(site.from_host):
            engine.connectStream(name, host.sender(j))
