"""embfuse's exceptions: each is also the class torch raises for the same mistake, so code
written against torch catches them; and where a warning should point (the user's line)."""

from __future__ import annotations

import os
import sys

import torch


class BadIdError(IndexError, RuntimeError):
    """An id outside its table. An IndexError, and a RuntimeError as torch raises for it."""


class BadBatchError(ValueError, RuntimeError):
    """Offsets or lengths that do not describe the input. A ValueError, and a RuntimeError as
    torch raises for it."""


class BadDtypeError(TypeError, RuntimeError):
    """A tensor of the wrong dtype. A TypeError, and a RuntimeError as torch raises for it."""


class BadCountsError(BadDtypeError, AssertionError):
    """Lengths or offsets that are not integers: a TypeError here, and the AssertionError
    TorchRec's jagged tensors raise."""


class BadArgumentError(ValueError, RuntimeError):
    """An argument torch refuses with a RuntimeError (a shape, a padding_idx out of range): a
    ValueError here, and a RuntimeError too."""


class UnsupportedError(ValueError, NotImplementedError):
    """An option torch refuses with NotImplementedError: a ValueError here, and that too."""


def caller_stacklevel() -> int:
    """The stacklevel of the first frame outside embfuse and torch's module plumbing (for
    warnings.warn called from this function's caller): the user's line, even when a module's
    forward made the call."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plumbing = os.path.join(os.path.dirname(torch.__file__), "nn", "modules")
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((ours, plumbing)):
        frame, level = frame.f_back, level + 1
    return level
