"""The one registry of changes this package makes to TensorFlow's Python internals.

TensorFlow has no public hook for a few things the RFC needs (what ``tensor.device``
shows, graph-op creation while a function is replayed, the Python-level tape hooks,
status-to-exception conversion). Each such change is a `Patch` registered here by the
module that owns it, with the reason it exists; nothing is patched at import. A patch
is installed when first needed:

- ``"runtime"`` patches when the first handler scope opens (`install_runtime`);
- others by their owner, around the work that needs them (`installed(name)` as a
  context manager, reference counted: graph-op creation only while a replay traces),
  or on first use (`ensure(name)`: the tape hooks on the first `oh.GradientTape`).

``oh.patches()`` lists them (name, target, reason, whether installed now):

>>> import tf_ophandlers as oh
>>> [p.name for p in oh.patches()]   # doctest: +SKIP
"""
import contextlib
import dataclasses
import threading
from typing import Callable, Optional

_lock = threading.RLock()
_registry = {}  # name -> Patch
_runtime_started = [False]


@dataclasses.dataclass
class Patch:
    """One change to TensorFlow: `install()` applies it, `uninstall()` reverts it."""

    name: str
    target: str   # what is replaced, e.g. "tensorflow.python.framework.ops.EagerTensor.device"
    reason: str   # why no public hook serves
    when: str     # "runtime" (first handler scope), "scoped" (while needed), "first-use"
    install: Callable[[], None]
    uninstall: Optional[Callable[[], None]]  # required for "scoped" patches
    installed: int = 0  # reference count (runtime / first-use patches stay at 1)

    def __repr__(self):
        return "<Patch %s (%s%s): %s>" % (self.name, self.when,
                                          ", installed" if self.installed else "", self.reason)


def register(name, target, reason, when, install, uninstall):
    """Registers a patch (idempotent per name); returns it."""
    if when not in ("runtime", "scoped", "first-use"):
        raise ValueError("tf_patches.register: unknown 'when' %r" % (when,))
    if when == "scoped" and uninstall is None:
        raise ValueError("tf_patches.register: scoped patch %s needs an uninstall" % name)
    with _lock:
        patch = _registry.get(name)
        if patch is None:
            patch = _registry[name] = Patch(name, target, reason, when, install, uninstall)
    if when == "runtime" and _runtime_started[0]:
        ensure(name)  # registered after the runtime started: needed now
    return patch


def ensure(name):
    """Installs patch `name` if it is not installed (it then stays installed)."""
    patch = _registry[name]
    if patch.installed:
        return
    with _lock:
        if not patch.installed:
            patch.install()
            patch.installed = 1


def install_runtime():
    """Installs every "runtime" patch (called once, when the dispatcher starts)."""
    with _lock:
        _runtime_started[0] = True
        for patch in list(_registry.values()):
            if patch.when == "runtime":
                ensure(patch.name)


def acquire(name):
    """Installs "scoped" patch `name` for one more user (reference counted, so nested and
    concurrent users share one installation); pair with `release(name)`."""
    patch = _registry[name]
    with _lock:
        if patch.installed == 0:
            patch.install()
        patch.installed += 1


def release(name):
    """Ends one `acquire(name)`; the last user's release uninstalls the patch."""
    patch = _registry[name]
    with _lock:
        patch.installed -= 1
        if patch.installed == 0:
            patch.uninstall()


@contextlib.contextmanager
def installed(name):
    """Keeps a "scoped" patch installed for the duration (`acquire`/`release`)."""
    acquire(name)
    try:
        yield
    finally:
        release(name)


def patches():
    """The registered patches, in registration order.

    Examples:
        >>> p = oh.patches()[0]
        >>> bool(p.name and p.reason), p.when in ("runtime", "scoped", "first-use")
        (True, True)
    """
    return list(_registry.values())
