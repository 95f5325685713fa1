"""Strings from the wire are hostile (docs/design.md, "The viewer and terminals"): make them safe to print in a terminal.

Layer names, run names and event messages come from another process. An OSC 52 escape in a
layer name would write to the user's clipboard; a bidi override would make ``fc1.weight`` read as
something else; a 1 MB name would wreck every layout. :func:`clean` removes all of that.
"""

from __future__ import annotations

import math
import re

# C0 controls (incl. ESC, CR, LF, TAB), DEL and C1 controls (incl. the 8-bit CSI \x9b),
# plus the Unicode bidi controls and other invisible format characters.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff\ufff9-\ufffb]")


def clean(s: object, max_len: int = 120) -> str:
    """Printable, single-line, at most ``max_len`` characters (an ellipsis marks a cut)."""
    text = s if isinstance(s, str) else str(s)
    if len(text) > 4 * max_len:
        text = text[: 4 * max_len]  # bound the regex work on huge inputs
    text = _UNSAFE.sub("\N{REPLACEMENT CHARACTER}", text)
    if len(text) > max_len:
        text = text[: max(1, max_len - 1)] + "\N{HORIZONTAL ELLIPSIS}"
    return text


_UNSAFE_BLOCK = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff\ufff9-\ufffb]")


def clean_block(s: str) -> str:
    """Like :func:`clean` for multi-line text (debugger output): keeps newlines and tabs, no length cut."""
    return _UNSAFE_BLOCK.sub("\N{REPLACEMENT CHARACTER}", s.replace("\r\n", "\n"))


def num(x: float | None, digits: int = 4) -> str:
    """A compact number that says plainly when it is not finite."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.{digits}g}"
    return f"{x:.{max(1, digits - 2)}e}"
