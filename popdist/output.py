"""Routing instance output to the terminal and to per-instance files.

Output is cut into segments that end at a newline or a carriage return, so a progress bar that
redraws itself with `\\r` keeps its tag on every redraw, and two instances never share a line.
A segment still open after `partial_flush_seconds` (a prompt, a bar between redraws) is shown
anyway; if another instance then writes to the same stream, the open line is ended first.

`--output-filename DIR` follows OpenMPI's layout, `DIR/1/rank.N/stdout` and `stderr`, and
receives each instance's bytes unchanged and untagged as they arrive.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

STREAMS = ("stdout", "stderr")


def tag(index: int, stream: str) -> bytes:
    """OpenMPI's output tag for instance `index`: `[1,N]<stdout>:` (job 1 is the application)."""
    return b"[1,%d]<%s>:" % (index, stream.encode())


def output_directory(base: str | os.PathLike, index: int) -> Path:
    """The directory OpenMPI's --output-filename uses for rank `index`."""
    return Path(base) / "1" / f"rank.{index}"


@dataclass
class _Source:
    pending: bytearray = field(default_factory=bytearray)
    pending_since: float = 0.0
    open_line: bool = False  # part of the current segment is already on the terminal
    file: BinaryIO | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=20))  # last whole lines
    tail_partial: bytearray = field(default_factory=bytearray)  # start of the current line


class OutputRouter:
    """Fans instance output out to the terminal streams and, optionally, per-instance files."""

    def __init__(self, *, tag_output: bool = False, only_instance: int | None = None,
                 output_dir: str | os.PathLike | None = None, copy_to_terminal: bool = True,
                 terminal: dict[str, BinaryIO] | None = None,
                 partial_flush_seconds: float = 0.25):
        self.tag_output = tag_output
        self.only_instance = only_instance
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.copy_to_terminal = copy_to_terminal
        self.terminal = terminal if terminal is not None else _default_terminal()
        self.partial_flush_seconds = partial_flush_seconds
        self._sources: dict[tuple[int, str], _Source] = {}
        self._open_owner: dict[str, tuple[int, str] | None] = {s: None for s in STREAMS}
        self._broken: set[str] = set()

    def add_instance(self, index: int) -> None:
        """Prepare the instance's sources (and its output files)."""
        for stream in STREAMS:
            source = _Source()
            if self.output_dir is not None:
                directory = output_directory(self.output_dir, index)
                directory.mkdir(parents=True, exist_ok=True)
                source.file = open(directory / stream, "wb", buffering=0)
            self._sources[(index, stream)] = source

    def shows(self, index: int) -> bool:
        """Whether instance `index` reaches the terminal."""
        return self.copy_to_terminal and self.only_instance in (None, index)

    def feed(self, index: int, stream: str, data: bytes, now: float | None = None) -> None:
        """Route bytes the instance wrote to `stream`."""
        source = self._sources[(index, stream)]
        if source.file is not None:
            source.file.write(data)
        if not source.pending:
            source.pending_since = time.monotonic() if now is None else now
        source.pending += data
        while True:
            cut = _first_terminator(source.pending)
            if cut < 0:
                break
            segment = bytes(source.pending[:cut])
            del source.pending[:cut]
            source.pending_since = time.monotonic() if now is None else now
            self._emit_segment(index, stream, source, segment)

    def flush_stale(self, now: float | None = None) -> None:
        """Show segments that have waited `partial_flush_seconds` for their line end."""
        now = time.monotonic() if now is None else now
        for (index, stream), source in self._sources.items():
            if source.pending and now - source.pending_since >= self.partial_flush_seconds:
                self._flush_pending(index, stream, source)

    def next_deadline(self) -> float | None:
        """When `flush_stale` next has something to do (a `time.monotonic()` value)."""
        times = [s.pending_since for s in self._sources.values() if s.pending]
        return min(times) + self.partial_flush_seconds if times else None

    def close(self, index: int, stream: str) -> None:
        """The instance closed `stream`: show what is left and end an open line."""
        source = self._sources[(index, stream)]
        if source.pending:
            self._flush_pending(index, stream, source)
        if source.open_line:
            self._write(stream, b"\n", (index, stream))
            source.open_line = False
            self._open_owner[stream] = None
        if source.file is not None:
            source.file.close()
            source.file = None

    def tail(self, index: int) -> list[str]:
        """The last lines the instance wrote to stderr (kept even when not shown)."""
        source = self._sources[(index, "stderr")]
        lines = [line.decode(errors="replace") for line in source.tail]
        unfinished = source.tail_partial + source.pending
        if unfinished:
            lines.append(unfinished.decode(errors="replace"))
        return lines

    def _flush_pending(self, index: int, stream: str, source: _Source) -> None:
        if source.pending.endswith(b"\r"):  # no \n followed the \r: a whole segment
            segment = bytes(source.pending)
            source.pending.clear()
            self._emit_segment(index, stream, source, segment)
        else:
            self._emit_partial(index, stream, source)

    def _emit_segment(self, index: int, stream: str, source: _Source, segment: bytes) -> None:
        body, end = segment.rstrip(b"\r\n"), segment[len(segment.rstrip(b"\r\n")):]
        if end.endswith(b"\n"):
            source.tail.append(source.tail_partial + body)
        source.tail_partial.clear()  # a line ended, or a \r starts redrawing it
        if not self.shows(index):
            return
        if source.open_line:
            data = segment
            source.open_line = False
            self._open_owner[stream] = None
        elif not body and end == b"\r":
            return  # a bare carriage return moves nothing once lines are whole
        else:
            data = (tag(index, stream) if self.tag_output else b"") + segment
        self._write(stream, data, (index, stream))

    def _emit_partial(self, index: int, stream: str, source: _Source) -> None:
        data = bytes(source.pending)
        source.pending.clear()
        source.tail_partial += data
        if not self.shows(index):
            return
        if not source.open_line:
            data = (tag(index, stream) if self.tag_output else b"") + data
        self._write(stream, data, (index, stream))
        source.open_line = True
        self._open_owner[stream] = (index, stream)

    def _write(self, stream: str, data: bytes, owner: tuple[int, str]) -> None:
        holder = self._open_owner[stream]
        if holder is not None and holder != owner:
            # another instance's line is open on this stream: end it before writing ours
            self._sources[holder].open_line = False
            self._open_owner[stream] = None
            data = b"\n" + data
        if stream in self._broken:
            return
        out = self.terminal[stream]
        try:
            out.write(data)
            out.flush()
        except BrokenPipeError:
            self._broken.add(stream)  # the reader went away; keep the instances running


def _first_terminator(buffer: bytearray) -> int:
    """Length of the first complete segment in `buffer`, or -1 when there is none yet.

    A `\\r` directly followed by `\\n` belongs to the same segment; a trailing `\\r` waits for
    the next byte to tell.
    """
    newline = buffer.find(b"\n")
    carriage = buffer.find(b"\r")
    if carriage < 0 or (0 <= newline < carriage):
        return newline + 1 if newline >= 0 else -1
    if carriage + 1 == len(buffer):
        return -1
    return carriage + 2 if buffer[carriage + 1] == 0x0A else carriage + 1


def _default_terminal() -> dict[str, BinaryIO]:
    import sys

    return {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
