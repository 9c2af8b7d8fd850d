"""Where Numba keeps ipusim's compiled kernels: one directory per version of ipusim's sources.

Numba checks a cached kernel against the file that defines it, and only that file: a kernel that
calls a jitted function of another module (kernels.py's load and store helpers, special.py's
functions) keeps the callee's old code after the callee's file changes, and gives old values (or
never ends) until its cache is emptied. Kept under a directory named by the size and time of
every source file of ipusim, a kernel is compiled afresh whenever any of them changed. The base
is NUMBA_CACHE_DIR when set, else ~/.cache/ipusim-numba (XDG_CACHE_HOME when set); the
directories of the `KEEP` versions used last are kept, older ones removed.

Imported by ``ipusim/__init__.py`` before any module that defines a cached kernel.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numba

PREFIX = "ipusim-"
KEEP = 4   # version directories kept (worktrees or installs of several versions side by side)


def sources_digest(root: Path) -> str:
    """A digest of the path, size and modification time of every Python file under `root`."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def base_directory() -> Path:
    configured = numba.config.CACHE_DIR
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ipusim-numba"


def use_versioned_cache() -> Path:
    """Point Numba's cache at this version's directory (made if needed) and remove the directories
    of versions not used lately; returns the directory."""
    base = base_directory()
    directory = base / f"{PREFIX}{sources_digest(Path(__file__).resolve().parent.parent)}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.utime(directory)   # most recently used
        others = sorted((p for p in base.glob(f"{PREFIX}*") if p != directory and p.is_dir()),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in others[KEEP - 1:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:
        return directory   # an unwritable base: Numba's own choice of directory stands
    numba.config.CACHE_DIR = str(directory)
    return directory
