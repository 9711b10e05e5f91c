"""Every change deepspeed_ext makes to DeepSpeed's own objects, in one place,
each with its undo.

* **Process-wide** (``everywhere``): a class or module attribute replaced for
  every engine. ``install()`` replaces ``DeepSpeedEngine.__init__`` so that a
  plain ``deepspeed.initialize`` honours the section; ``restore_everywhere()``
  (what ``uninstall()`` calls) puts every one back.
* **For one call** (``swapped``): ZeRO's step calls the module function
  ``stage_1_and_2.all_gather_dp_groups``; a compressed ZeRO optimizer puts
  its parameter pass there for the duration of its own step only, so no
  other optimizer, and nothing after the step, ever sees it.
* **For one object** (``on``): an engine's or optimizer's method (its
  gradient allreduce, its step, its checkpoint methods). It lives and dies
  with that object; ``restore_on(obj)`` undoes them.

Nothing else in deepspeed_ext assigns to a DeepSpeed object's methods.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

_MISSING = object()


class Override:
    """``owner.name`` replaced by ``replacement``; ``previous`` is what it
    was (a bound method for an instance), ``undo()`` puts it back."""

    def __init__(self, owner: Any, name: str, replacement: Any):
        self.owner, self.name, self.replacement = owner, name, replacement
        self.previous = getattr(owner, name)
        self._own = vars(owner).get(name, _MISSING)  # the owner's own attribute, or inherited (then deleted on undo)
        setattr(owner, name, replacement)

    @property
    def active(self) -> bool:
        return vars(self.owner).get(self.name, _MISSING) is self.replacement

    def undo(self) -> None:
        if not self.active:
            return
        if self._own is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._own)


_everywhere: dict[tuple[int, str], Override] = {}
_on: "weakref.WeakKeyDictionary[Any, list[Override]]" = weakref.WeakKeyDictionary()


def everywhere(owner: Any, name: str, replacement: Any) -> Override:
    """Replace a class's or module's attribute for the whole process (once:
    a second call for the same attribute returns the first override)."""
    key = (id(owner), name)
    if key not in _everywhere or not _everywhere[key].active:
        _everywhere[key] = Override(owner, name, replacement)
    return _everywhere[key]


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before ``everywhere`` replaced it (or is, if it was not)."""
    override = _everywhere.get((id(owner), name))
    return override.previous if override is not None and override.active else getattr(owner, name)


def restore_everywhere() -> None:
    """Undo every process-wide override, newest first."""
    for key in list(_everywhere)[::-1]:
        _everywhere.pop(key).undo()


@contextlib.contextmanager
def swapped(owner: Any, name: str, replacement: Any) -> Iterator[Override]:
    """``owner.name`` replaced for the duration of a block."""
    override = Override(owner, name, replacement)
    try:
        yield override
    finally:
        override.undo()


def on(obj: Any, name: str, replacement: Any) -> Override:
    """Replace one object's attribute (its method, for that object alone)."""
    override = Override(obj, name, replacement)
    _on.setdefault(obj, []).append(override)
    return override


def restore_on(obj: Any) -> None:
    """Undo every override made ``on`` this object, newest first."""
    for override in reversed(_on.pop(obj, [])):
        override.undo()
