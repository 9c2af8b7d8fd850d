"""A compiled model in a file: ``PoplarExecutor.compileAndExport`` / ``save`` write it,
``poptorch.load`` (and ``PoplarExecutor.loadExecutable``) read it back.

File: a magic line, a JSON header line (format, software versions, the byte size and SHA-256 of
each of the two payloads), then the payloads:

1. the model's data, pickled: whether it trains, its options, the call it was compiled for (the
   example arguments, as given), and with ``export_model`` the torch model (with the weights it
   had, as the user's class) and its optimiser (with its state), and with ``save_rng_state`` the
   device's random generator state (``PoplarExecutor.rng_state``);
2. the executable, as the executable cache stores it (``runtime.cache.serialize``).

Like cache entries the file is a pickle: load only files you trust.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..api.errors import Error
from . import cache

MAGIC = b"poptorch_lite model\n"
FORMAT_VERSION = 1


@dataclass
class SavedModel:
    """What a file holds besides the executable."""
    training: bool
    options: Any
    call: tuple                             # (args, kwargs) the model was compiled for
    model: Optional[torch.nn.Module] = None
    optimizer: Any = None
    optimizer_state: Optional[dict] = None
    rng_state: Optional[list] = None
    extra: dict = field(default_factory=dict)


def write(filename: str, saved: SavedModel, executable) -> None:
    """Write `saved` and `executable` to `filename` (its directory made if missing)."""
    directory = os.path.dirname(os.path.abspath(filename))
    os.makedirs(directory, exist_ok=True)
    buffer = io.BytesIO()
    optimizer = saved.optimizer
    hook = optimizer.__dict__.pop("state_dict", None) if optimizer is not None else None  # the device-reading hook
    try:
        pickle.dump(saved, buffer, protocol=4)
    finally:
        if hook is not None:
            optimizer.state_dict = hook
    payloads = [buffer.getvalue(), cache.serialize(executable)]
    header = {"format": FORMAT_VERSION, "software": cache.software_versions(),
              "payloads": [{"bytes": len(p), "sha256": hashlib.sha256(p).hexdigest()} for p in payloads]}
    tmp = f"{filename}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + json.dumps(header).encode() + b"\n")
        for p in payloads:
            f.write(p)
    os.replace(tmp, filename)


def read(filename: str) -> tuple[SavedModel, Any]:
    """The model data and the executable (its engine loaded) of a file `write` made; an Error
    names what is wrong with any other file."""
    payloads = _payloads(filename)
    saved = pickle.loads(payloads[0])
    executable = cache.deserialize(payloads[1])
    executable.engine.load()
    return saved, executable


def importPoptorchMetadataFromFile(filename: str) -> bytes:  # pylint: disable=invalid-name
    """The model data of a saved file (the first payload, a pickled :class:`SavedModel`), checked,
    without loading its executable."""
    return bytes(_payloads(filename)[0])


def _payloads(filename: str) -> list[memoryview]:
    try:
        with open(filename, "rb") as f:
            data = f.read()
    except OSError as error:
        raise Error(f"Cannot read the saved model {filename!r}: {error}") from None
    if not data.startswith(MAGIC):
        raise Error(f"Invalid file {filename}: not a model saved by compileAndExport / save")
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError:
        raise Error(f"Invalid file {filename}: corrupt header") from None
    if header.get("format") != FORMAT_VERSION:
        raise Error(f"Invalid file {filename}: format {header.get('format')}, this version reads {FORMAT_VERSION}")
    if header.get("software") != cache.software_versions():
        raise Error(f"Invalid file {filename}: saved by other software ({header.get('software')}); compile and "
                    "export the model again with this version")
    offset, payloads = end + 1, []
    for entry in header["payloads"]:
        payload = memoryview(data)[offset:offset + entry["bytes"]]
        if len(payload) != entry["bytes"] or hashlib.sha256(payload).hexdigest() != entry["sha256"]:
            raise Error(f"Invalid file {filename}: truncated or corrupt")
        payloads.append(payload)
        offset += entry["bytes"]
    return payloads
