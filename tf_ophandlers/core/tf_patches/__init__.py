"""Every change this package makes to TensorFlow's (and Keras's) Python internals.

TensorFlow has no public hook for a few things the RFC needs (what ``tensor.device``
shows, graph-op creation while a function is replayed, the Python-level tape hooks,
status-to-exception conversion). This folder is the only code that assigns attributes of
TensorFlow modules and classes (`tests/core/test_tf_patches.py` checks it):

- `registry.py`: the machinery. A `Patch` per TensorFlow symbol, installed while one of
  its subscribers is active, restoring TensorFlow's objects when the last one ends.
- `uses.py`: the uses (one owner's need: "tape hooks", "Context.device"), when each
  starts and why.
- `eager.py`, `framework.py`, `keras.py`: the patches, one per symbol, each with the
  reason no public hook serves and its subscribers in order (innermost first), each
  place with the reason for it.

A handler outside the package that needs a symbol declares its use (`declare_use`) and,
for a symbol no patch covers yet, the patch (`declare(name, [Symbol(module, path)],
reason, [(use, why)])`), then subscribes; `register(name, target, reason, when, install,
uninstall)` remains for a change that is no attribute (it is listed like the others).

Owners keep their logic and subscribe at import: ``subscribe(patch, use, wrap)``, where
``wrap(next)`` returns the replacement, which calls ``next`` (TensorFlow's object, or
the wrapper of the subscriber below). Nothing is patched at import; a use starts

- ``"runtime"``: when the first handler scope opens (`install_runtime`);
- ``"first-use"``: on the owner's `ensure(use)` (the tape hooks on the first
  `oh.GradientTape`), then for good;
- ``"scoped"``: while held (`installed(use)` as a context manager, or
  `acquire`/`release`, reference counted: graph-op creation only while a replay traces).

``oh.patches()`` lists the patches (name, target, reason, whether installed now, the
subscribers in order):

>>> import tf_ophandlers as oh
>>> [p.name for p in oh.patches()]   # doctest: +SKIP
"""
import contextlib

from tf_ophandlers.core.tf_patches import uses as _uses  # noqa: F401  (declares the uses)
from tf_ophandlers.core.tf_patches import eager as _eager  # noqa: F401
from tf_ophandlers.core.tf_patches import framework as _framework  # noqa: F401
from tf_ophandlers.core.tf_patches import keras as _keras  # noqa: F401
from tf_ophandlers.core.tf_patches.registry import (  # noqa: F401
    Patch, Registration, Symbol, Use, WHENS, acquire, declare, declare_use, ensure,
    install_runtime, register, release, subscribe, uninstall_all, uses)
from tf_ophandlers.core.tf_patches.registry import patches as _patches


@contextlib.contextmanager
def installed(name):
    """Keeps "scoped" use `name` active for the duration (`acquire`/`release`)."""
    acquire(name)
    try:
        yield
    finally:
        release(name)


def patches():
    """The patches, one per TensorFlow symbol, in declaration order.

    Examples:
        >>> p = oh.patches()[0]
        >>> bool(p.name and p.reason), p.when in ("runtime", "scoped", "first-use")
        (True, True)
    """
    return _patches()
