"""PopTorch's exception classes.

PopTorch reports what goes wrong in its compiler and runtime as `poptorch.Error`, with two
subclasses for failures at run time: `RecoverableError` (the run failed; `recovery_action` says
what brings the device back) and `UnrecoverableError` (the device or process is lost). Every
error has `type` (the kind of error), `message` (the text without context) and `location` (where
it was raised, when known). The project's own errors that PopTorch reports as an `Error` derive
from it as well as from the Python class that fits them (`BlockError` is an `Error` and a
`RuntimeError`), so both `except poptorch.Error` and `except RuntimeError` catch them.

`context(what)` names what the code inside it is doing, as PopTorch's log contexts do: an `Error`
leaving the innermost open context gets the stack of open contexts as its `location` (innermost
first, `  [0] ...`), appended to its text after "Error raised in:".
"""
from __future__ import annotations

import contextlib
import threading


class Error(Exception):
    """An error reported by PopTorch (here: by poptorch_lite's compiler or runtime)."""

    type = "poptorch_py_error"
    location = ""

    @property
    def message(self) -> str:
        """The error's text without its type and location."""
        if "_message" in self.__dict__:
            return self.__dict__["_message"]
        return str(self.args[0]) if self.args else ""

    @message.setter
    def message(self, value: str) -> None:
        self.__dict__["_message"] = value


class RecoverableError(Error):
    """A run failed, but the device can be used again after `recovery_action`."""

    recovery_action = ""


class UnrecoverableError(Error):
    """A run failed and the device cannot be used again in this process."""


class UnsupportedAttributeError(AttributeError, NotImplementedError):
    """A PopTorch function, class, constant or option that poptorch_lite does not provide."""


class UnsupportedModuleError(ModuleNotFoundError, NotImplementedError):
    """A PopTorch module that poptorch_lite does not provide."""


def make(message: str, *, cls: type = Error, type: str = Error.type,  # pylint: disable=redefined-builtin
         recovery_action: str = "") -> Error:
    """An error of class `cls` (Error or a subclass) with PopTorch's fields: its text is
    ``'<type>': <message>`` (and the recovery action a RecoverableError requires), `message`
    the bare message."""
    text = f"'{type}': {message}"
    if recovery_action:
        text += f"\nRecovery action required: {recovery_action}"
    error = cls(text)
    error.type = type
    error.message = message
    if recovery_action:
        error.recovery_action = recovery_action
    return error


def createPoptorchError(msg: str) -> Error:  # pylint: disable=invalid-name
    """A ``poptorch.Error`` raised from Python (type ``poptorch_py_error``), as PopTorch makes them."""
    return make(msg)


_local = threading.local()


def _contexts() -> list[str]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_location() -> str:
    """The open contexts of this thread, innermost first, as PopTorch prints them ("" if none)."""
    stack = _contexts()
    return "".join(f"  [{i}] {what}\n" for i, what in enumerate(reversed(stack)))


@contextlib.contextmanager
def context(what: str):
    """Name what the body does; an Error leaving it without a location gets the open contexts."""
    stack = _contexts()
    stack.append(what)
    try:
        yield
    except Error as error:
        if not error.location:
            error.message = error.message  # the text without the location that follows
            error.location = current_location()
            if error.args:
                error.args = (f"{error.args[0]}\nError raised in:\n{error.location}",) + error.args[1:]
        raise
    finally:
        stack.pop()
