"""How `ipu_print_tensor` shows a tensor: Poplar's PrintTensor layout.

The device copies the tensor to the host, which writes `title: <tensor>` to stderr. A tensor of
rank 1 is its elements between brackets, joined by the separator and wrapped at the line width;
a tensor of higher rank puts each sub-tensor on its own line, indented by its depth, with the
closing bracket on a line of its own. Tensors with more elements than the summarise threshold
show `edge_items` elements at each end of every dimension around `...`. Floats have `digits`
significant digits in fixed or scientific notation ("auto" picks fixed unless the magnitudes need
an exponent; "none" prints each value as short as it goes) and are aligned to a common width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")


@dataclass(frozen=True)
class PrintFormat:
    summarise_threshold: int = 1000
    edge_items: int = 3
    max_line_width: int = 80
    digits: int = 4
    float_format: str = "auto"
    separator: str = ", "
    open_bracket: str = "("
    close_bracket: str = ")"

    def __post_init__(self):
        if self.float_format not in FLOAT_FORMATS:
            raise ValueError(f"ipu_print_tensor: float_format must be one of {FLOAT_FORMATS}, "
                             f"got {self.float_format!r}")
        for name in ("summarise_threshold", "edge_items", "max_line_width", "digits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ipu_print_tensor: {name} must be an int >= 0, got {value!r}")


_SKIPPED = object()


def _elements(array: np.ndarray, fmt: PrintFormat) -> list[str]:
    """Every element of `array` as text, in one style and (with digits) one width."""
    flat = array.reshape(-1)
    if np.issubdtype(array.dtype, np.floating):
        finite = np.abs(flat[np.isfinite(flat)].astype(np.float64))
        style = fmt.float_format
        if style == "auto":
            big = finite.size and (finite.max() >= 1e8 or 0 < finite[finite > 0].min(initial=1.0) < 1e-4)
            style = "scientific" if big else "fixed"
        if style == "none" or fmt.digits == 0:
            texts = [repr(float(v)) for v in flat]
        elif style == "scientific":
            texts = [f"{float(v):.{max(fmt.digits - 1, 0)}e}" for v in flat]
        else:
            largest = finite.max() if finite.size else 0.0
            integer_digits = max(int(math.floor(math.log10(largest))) + 1, 1) if largest >= 1 else 1
            texts = [f"{float(v):.{max(fmt.digits - integer_digits, 0)}f}" for v in flat]
    elif array.dtype == np.bool_:
        texts = ["true" if v else "false" for v in flat]
    else:
        texts = [str(int(v)) for v in flat]
    if fmt.digits:
        width = max((len(t) for t in texts), default=0)
        texts = [t.rjust(width) for t in texts]
    return texts


def _kept(size: int, fmt: PrintFormat, summarise: bool) -> list:
    if not summarise or size <= 2 * fmt.edge_items:
        return list(range(size))
    return list(range(fmt.edge_items)) + [_SKIPPED] + list(range(size - fmt.edge_items, size))


def format_tensor(array: np.ndarray, fmt: PrintFormat) -> str:
    """`array` in the PrintTensor layout (without the title)."""
    array = np.asarray(array)
    summarise = fmt.summarise_threshold > 0 and array.size > fmt.summarise_threshold
    texts = np.array(_elements(array, fmt), dtype=object).reshape(array.shape)
    if array.ndim == 0:
        return texts.item()

    def rank1(row, depth: int) -> str:
        items = ["..." if i is _SKIPPED else row[i] for i in _kept(len(row), fmt, summarise)]
        line = fmt.open_bracket
        lines = []
        for k, item in enumerate(items):
            last = k == len(items) - 1
            piece = item + (fmt.close_bracket if last else fmt.separator)
            if fmt.max_line_width and k and len(line) + len(piece) > fmt.max_line_width - depth:
                lines.append(line.rstrip())
                line = "  " + piece  # continued one column past the first element
            else:
                line += piece
        lines.append(line)
        return ("\n" + " " * depth).join(lines)

    def nested(sub, depth: int) -> str:
        if sub.ndim == 1:
            return rank1(sub, depth)
        rows = ["..." if i is _SKIPPED else nested(sub[i], depth + 1) for i in _kept(len(sub), fmt, summarise)]
        inner = " " * (depth + 1)
        return fmt.open_bracket + "\n" + "".join(inner + r + "\n" for r in rows) + " " * depth + fmt.close_bracket

    return nested(texts, 0)
