"""Run an unmodified PopTorch program on emulated IPUs.

    poptorch-lite run script.py [args ...]
    poptorch-lite run -m package.module [args ...]
    python -m poptorch_lite run script.py [args ...]

For the run (and the processes it spawns, such as asynchronous data loaders) `import poptorch`
and `import poptorch.<sub>` give `poptorch_lite` and its API modules (`poptorch_lite.api.<sub>`), `import popdist` gives
this project's `popdist` (with `popdist.poptorch`) and `import popart` PopART's names that PopTorch programs
use (`poptorch_lite.api.popart`: its enums and session options), even when a Poplar SDK is installed. Nothing
changes outside the run. A PopTorch name `poptorch_lite` does not provide fails at the point of
use with an error naming it (`UnsupportedAttributeError` / `UnsupportedModuleError`, both
`NotImplementedError`s), so an unsupported call can never pass silently.
"""
from __future__ import annotations

import argparse
import atexit
import difflib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import shutil
import sys
import tempfile
import types

from .api.errors import UnsupportedAttributeError, UnsupportedModuleError

ALIAS = "poptorch"
TARGET = "poptorch_lite"
POPART = "popart"
POPART_TARGET = "poptorch_lite.api.popart"
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = """\
# Created by poptorch_lite.runner for one run: `import poptorch` in a process spawned by the run
# means poptorch_lite there too.
import poptorch_lite.runner
poptorch_lite.runner.install()
"""


def _unsupported(name: str, provider: types.ModuleType) -> str:
    """The error message for PopTorch's `name`, which `provider` (a poptorch_lite module) lacks."""
    module, _, attr = name.rpartition(".")
    close = difflib.get_close_matches(attr, _public(provider), n=3)
    hint = f" Did you mean {', '.join(f'{module}.{c}' for c in close)}?" if close else ""
    return (f"{name} is not supported by {TARGET} (PopTorch's API on emulated IPUs), so this program cannot "
            f"run unchanged.{hint} `help({provider.__name__})` lists what {module} provides here.")


def _public(module: types.ModuleType) -> list[str]:
    return sorted(getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")])


class AliasModule(types.ModuleType):
    """`poptorch` or `poptorch.<sub>`: serves the attributes of the poptorch_lite module it
    stands for, and refuses the others with an error naming them."""

    def __init__(self, name: str, target: types.ModuleType):
        super().__init__(name, target.__doc__)
        self.__dict__["_alias_target"] = target

    def __getattr__(self, attr: str):
        target = self.__dict__["_alias_target"]
        try:
            value = getattr(target, attr)
        except AttributeError:
            if attr.startswith("__") and attr.endswith("__"):
                raise  # protocol probes (__wrapped__, __path__ of a plain module...) stay ordinary
            raise UnsupportedAttributeError(_unsupported(f"{self.__name__}.{attr}", target),
                                            name=attr, obj=self) from None
        if isinstance(value, types.ModuleType) and value.__name__.startswith(TARGET + "."):
            value = importlib.import_module(f"{self.__name__}.{attr}")  # the alias of the submodule
        self.__dict__[attr] = value
        return value

    def __dir__(self):
        return sorted(set(dir(self.__dict__["_alias_target"])) | set(self.__dict__))

    def __repr__(self):
        return f"<module {self.__name__!r} (alias of {self.__dict__['_alias_target'].__name__!r})>"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return AliasModule(spec.name, importlib.import_module(self.target))

    def exec_module(self, module):
        """Nothing to run: the alias serves the target module's attributes."""


class PopTorchFinder(importlib.abc.MetaPathFinder):
    """Resolves `poptorch[.sub]` to aliases of `poptorch_lite[.sub]`, `popdist` to this
    project's package and `popart` to an alias of `poptorch_lite.api.popart`."""

    def find_spec(self, fullname, path=None, target=None):
        head, dot, rest = fullname.partition(".")
        if fullname == "popdist":
            return importlib.machinery.PathFinder.find_spec("popdist", [PROJECT_ROOT])
        if head == POPART:
            if rest:
                raise UnsupportedModuleError(_unsupported(fullname, importlib.import_module(POPART_TARGET)),
                                             name=None)
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(POPART_TARGET))
        if head != ALIAS:
            return None
        real = _real_module(rest) if rest else TARGET
        if importlib.util.find_spec(real) is None:
            parent = importlib.import_module(real.rpartition(".")[0])
            if hasattr(parent, real.rpartition(".")[2]):  # a class or function, not a module
                raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
            raise UnsupportedModuleError(_unsupported(fullname, parent), name=None)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), is_package=True)


def _real_module(sub: str) -> str:
    """The poptorch_lite module behind `poptorch.<sub>`: PopTorch's public submodules
    (`poptorch.optim`, `poptorch.enums`, ...) are the API layer's modules."""
    api = f"{TARGET}.api.{sub}"
    try:
        if importlib.util.find_spec(api) is not None:
            return api
    except ModuleNotFoundError:  # a parent of a nested name is missing
        pass
    return f"{TARGET}.{sub}"


def install() -> None:
    """Make `poptorch`, `popdist` and `popart` resolve to this project in this process (idempotent)."""
    if not any(isinstance(f, PopTorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PopTorchFinder())
    for name in [n for n in sys.modules if n in (ALIAS, POPART) or n.startswith((ALIAS + ".", POPART + "."))]:
        if not isinstance(sys.modules[name], AliasModule):
            del sys.modules[name]  # an SDK's poptorch / popart or the spawn shim: replaced by the alias
    if "popdist" in sys.modules and not os.path.abspath(sys.modules["popdist"].__file__ or "").startswith(
            os.path.join(PROJECT_ROOT, "popdist")):
        for name in [n for n in sys.modules if n == "popdist" or n.startswith("popdist.")]:
            del sys.modules[name]
    sys.modules[ALIAS] = importlib.import_module(ALIAS)


def _spawn_shim() -> str:
    """A directory holding a `poptorch` package that calls `install()`: processes spawned by
    the run (multiprocessing's spawn and forkserver start a fresh interpreter that re-imports
    the program with the parent's sys.path) find it, and alias `poptorch` as this one does."""
    directory = tempfile.mkdtemp(prefix="poptorch_lite_run_")
    os.mkdir(os.path.join(directory, ALIAS))
    with open(os.path.join(directory, ALIAS, "__init__.py"), "w", encoding="utf-8") as f:
        f.write(SHIM)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def run_program(program: str, args: list[str], as_module: bool = False) -> None:
    """Run `program` (a script path, or a module name when `as_module`) as `__main__` with
    `sys.argv[1:] = args`, PopTorch imports resolving to this project."""
    if as_module:
        if importlib.util.find_spec(program) is None:
            raise SystemExit(f"poptorch-lite run: no module named {program!r}")
        sys.argv = [program, *args]
        sys.path[0] = os.getcwd()
    else:
        if not os.path.isfile(program):
            raise SystemExit(f"poptorch-lite run: no such file: {program!r}")
        sys.argv = [program, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(program))
    sys.path.insert(1, _spawn_shim())
    install()
    if as_module:
        runpy.run_module(program, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(program, run_name="__main__")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="poptorch-lite",
        description="Run PopTorch programs on emulated IPUs: `import poptorch` and `import popdist` "
                    "resolve to this project for the program's run.")
    commands = p.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a PopTorch script or module unchanged",
                              description="Run a PopTorch script (or -m module) unchanged on emulated IPUs.")
    run.add_argument("-m", dest="module", action="store_true", help="PROGRAM is a module name, as in python -m")
    run.add_argument("program", help="the script to run (or the module, with -m)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return p


def main(argv: list[str] | None = None) -> None:
    options = parser().parse_args(argv)
    run_program(options.program, options.args, as_module=options.module)
