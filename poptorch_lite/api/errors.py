"""PopTorch's exception classes.

PopTorch reports what goes wrong in its compiler and runtime as `poptorch.Error`, with two
subclasses for failures at run time: `RecoverableError` (the run failed; `recovery_action` says
what brings the device back) and `UnrecoverableError` (the device or process is lost). Every
error has `type` (the kind of error), `message` (the text without context) and `location` (where
it was raised, when known). The project's own errors that PopTorch reports as an `Error` derive
from it as well as from the Python class that fits them (`BlockError` is an `Error` and a
`RuntimeError`), so both `except poptorch.Error` and `except RuntimeError` catch them.
"""
from __future__ import annotations


class Error(Exception):
    """An error reported by PopTorch (here: by poptorch_lite's compiler or runtime)."""

    type = "poptorch_py_error"
    location = ""

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class RecoverableError(Error):
    """A run failed, but the device can be used again after `recovery_action`."""

    recovery_action = ""


class UnrecoverableError(Error):
    """A run failed and the device cannot be used again in this process."""


class UnsupportedAttributeError(AttributeError, NotImplementedError):
    """A PopTorch function, class, constant or option that poptorch_lite does not provide."""


class UnsupportedModuleError(ModuleNotFoundError, NotImplementedError):
    """A PopTorch module that poptorch_lite does not provide."""
