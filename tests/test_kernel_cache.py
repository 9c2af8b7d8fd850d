"""Numba's kernel cache is kept per version of ipusim's sources (ipusim/device/kernel_cache.py)."""
import os
import subprocess
import sys

import numba

from ipusim.device import kernel_cache


def test_the_digest_changes_with_any_source_file(tmp_path):
    (tmp_path / "ops").mkdir()
    callee = tmp_path / "ops" / "special.py"
    callee.write_text("def f(x):\n    return x\n")
    (tmp_path / "elementwise.py").write_text("from ops.special import f\n")
    (tmp_path / "notes.txt").write_text("not a source")
    before = kernel_cache.sources_digest(tmp_path)
    assert kernel_cache.sources_digest(tmp_path) == before
    (tmp_path / "notes.txt").write_text("still not a source")
    assert kernel_cache.sources_digest(tmp_path) == before
    stat = callee.stat()
    os.utime(callee, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))   # the callee edited, same size
    assert kernel_cache.sources_digest(tmp_path) != before


def test_each_version_has_its_directory_and_old_ones_go(tmp_path, monkeypatch):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    for age, name in enumerate(["ipusim-old0", "ipusim-old1", "ipusim-old2", "ipusim-old3", "ipusim-old4"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1000 + age, 1000 + age))
    (tmp_path / "other-project").mkdir()
    directory = kernel_cache.use_versioned_cache()
    assert numba.config.CACHE_DIR == str(directory) and directory.parent == tmp_path
    assert directory.name.startswith("ipusim-") and directory.is_dir()
    left = sorted(p.name for p in tmp_path.iterdir())
    # this version's and the KEEP - 1 used last before it; what is not ipusim's stays
    assert left == sorted([directory.name, "ipusim-old2", "ipusim-old3", "ipusim-old4", "other-project"])


def test_an_imported_ipusim_caches_its_kernels_under_its_version(tmp_path):
    code = "import ipusim, numba; print(numba.config.CACHE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.dirname(out) == str(tmp_path) and os.path.basename(out).startswith("ipusim-")
