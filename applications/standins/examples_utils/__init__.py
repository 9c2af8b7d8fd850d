"""Stand-in for Graphcore's `examples_utils` (github.com/graphcore/examples-utils) as the BERT
application uses it: `load_lib(path)` builds a C++ file into a library and loads it. The one the
application loads (custom_ops/workarounds/residual_add_inplace_pattern.cpp) registers a PopART
pattern that changes which op runs in place, never a value; the emulator has no PopART to
register it in, so `load_lib` checks the source is there, records its path in `loaded` and
builds nothing (tests/test_applications_bert.py shows the values do not change with it)."""
from __future__ import annotations

import os

loaded: list[str] = []

# C++ sources whose effect is a PopART pattern (how the graph is scheduled or made in place): no
# value changes, so the emulator can run without them.
NO_VALUE_EFFECT = ("residual_add_inplace_pattern.cpp",)


def load_lib(cpp_file: str, timeout: int = 5 * 60):
    """Record `cpp_file`; refuse a C++ op whose values the emulator cannot compute."""
    if not os.path.isfile(cpp_file):
        raise FileNotFoundError(f"load_lib: no such C++ source: {cpp_file}")
    if os.path.basename(cpp_file) not in NO_VALUE_EFFECT:
        raise NotImplementedError(
            f"load_lib({cpp_file!r}): this C++ library may change values and cannot be built for emulated IPUs; "
            f"register its op with poptorch.register_custom_op instead")
    loaded.append(os.path.abspath(cpp_file))
    return None
