"""Integer names for the Python objects a torch.compile graph must refer to.

A fused lookup's backward needs its optimizer (and step count), a collection's Plan, a hot-row
set: Python objects, which torch.library ops cannot take and `torch.compiler.assume_constant_result`
(torch 2.11) cannot either. Each such object gets an int when it is made, outside any trace; a
traced graph carries the int and the ops look the object up. Weak references: a name dies with
its object, as the module that made it (and the graphs compiled for it) do. A copy of a named
object (copy.deepcopy, pickle) is named anew: `Named`.
"""

from __future__ import annotations

import itertools
import weakref

_OBJECTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(obj) -> int:
    """Name `obj` (once): its int, also kept as `obj._embfuse_handle`."""
    handle = getattr(obj, "_embfuse_handle", None)
    if handle is None:
        handle = obj._embfuse_handle = next(_NEXT)
        _OBJECTS[handle] = obj
    return handle


class Named:
    """Mixin for registered objects: copies (copy.deepcopy, pickle) drop the original's name and
    take their own, so a copied module's graphs never reach the original."""

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_embfuse_handle", None)
        return state

    def __setstate__(self, state):
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)
        register(self)


def lookup(handle: int):
    return _OBJECTS[handle]


def as_constant(value):
    """A lookup argument as a trace constant: None, ints and strings as they are, a registered
    object as ("object", its int)."""
    if value is None or isinstance(value, (int, str)):
        return value
    handle = getattr(value, "_embfuse_handle", None)
    if handle is None:
        raise TypeError(f"a {type(value).__name__} made inside a traced graph cannot be named by it: a fused "
                        f"optimizer's lookup compiles only with objects made outside the trace")
    return ("object", handle)


def from_constant(value):
    return lookup(value[1]) if isinstance(value, tuple) else value


# names (features, tables) passed to a torch.library op as one string: ops take no list of
# strings. Not joined by newlines: Inductor copies op arguments into comment lines of the code it
# generates, and a newline there ends the comment (a SyntaxError, torch 2.11).
NAME_SEPARATOR = "\t"


def join_names(names) -> str:
    return NAME_SEPARATOR.join(names)


def split_names(joined: str) -> list[str]:
    return joined.split(NAME_SEPARATOR)
