"""The machinery of the patch registry: symbols, patches, uses and their subscribers.

A `Patch` replaces one TensorFlow symbol (an attribute of a TensorFlow or Keras module or
class; a few patches cover a family of such attributes that one wrapper serves, such as
every tf.errors class's `__init__`, or an alias TensorFlow keeps of the same object, such
as `tf.get_static_value` of `tensor_util.constant_value`). It is the only code that
assigns the attribute. It owns the replacement: the composition of its subscribers'
wrappers, in the order the patch declares (innermost first), over TensorFlow's object.

A *use* is the need of one owner (a core module or a handler) for its subscriptions:
named ("tape hooks"), with the time it starts (`when`). An owner subscribes at import
(`subscribe(patch, use, wrap)`: `wrap(next)` returns the replacement that calls `next`,
TensorFlow's object or the wrapper of the subscriber below) and starts its use when
needed (`ensure`, `acquire`/`release`, or the runtime start for "runtime" uses). A patch
is installed while one of its subscribers' uses is active; when the last one ends, the
patch puts TensorFlow's objects back.
"""
import dataclasses
import importlib
import threading
from typing import Callable, Optional

from tensorflow.python.autograph.impl.api import autograph_artifact

WHENS = ("runtime", "scoped", "first-use")

_lock = threading.RLock()
_patches = {}  # name -> Patch, in declaration order
_uses = {}  # name -> Use
_use_patches = {}  # use name -> its patches (cleared when a patch is declared)
_runtime_started = [False]
_MISSING = object()


class Symbol:
    """One attribute of TensorFlow: `module` (imported when first needed, so Keras is not
    imported until a Keras patch installs) and the dotted `path` in it ("Context.device").
    `alias`: the attribute gets the replacement of the patch's first symbol, and only if
    it held the same object as that one (TensorFlow's `execute.execute` is
    `quick_execute` unless op callbacks are on)."""

    def __init__(self, module, path, alias=False):
        self.module = module
        self.path = path
        self.alias = alias
        self._holder = None

    def __repr__(self):
        return "%s.%s" % (self.module, self.path)

    def holder(self):
        """(the object whose attribute this is, the attribute's name), found once (a
        module or class keeps its identity; scoped patches come and go often)."""
        if self._holder is None:
            obj = importlib.import_module(self.module)
            parts = self.path.split(".")
            for part in parts[:-1]:
                obj = getattr(obj, part)
            self._holder = (obj, parts[-1])
        return self._holder

    def read(self):
        """The attribute's value as an attribute access gives it (a class's inherited
        method, a descriptor looked up on the class)."""
        obj, attr = self._holder or self.holder()
        return getattr(obj, attr, None)  # (None: an attribute the patch adds)

    def read_own(self):
        """What the holder itself stores (`_MISSING` for a class attribute it inherits):
        restoring that, not the inherited value, leaves the class as it was."""
        obj, attr = self._holder or self.holder()
        if isinstance(obj, type):
            return obj.__dict__.get(attr, _MISSING)
        return getattr(obj, attr, _MISSING)

    def write(self, value):
        obj, attr = self._holder or self.holder()
        if value is _MISSING:
            if isinstance(obj, type) and attr in obj.__dict__ or \
                    not isinstance(obj, type) and hasattr(obj, attr):
                delattr(obj, attr)
        else:
            setattr(obj, attr, value)


class Registration:
    """A symbol TensorFlow keeps in C and lets Python set but not read (the gradient
    function its tapes call): `original()` is the function TensorFlow registers itself,
    `register(fn)` sets it. Restored by registering the original again."""

    def __init__(self, name, original, register):
        self.path = name
        self.alias = False
        self._original = original
        self._register = register
        self._current = _MISSING

    def __repr__(self):
        return self.path

    def read(self):
        return self._original() if self._current is _MISSING else self._current

    def read_own(self):
        return self.read()

    def write(self, value):
        self._register(value)
        self._current = _MISSING if value is self._original() else value


@dataclasses.dataclass
class Subscriber:
    """A use's place on a patch: declared by the patch (`use`, `why`), filled by the
    owner's `subscribe` (`wrap`)."""

    use: str
    why: str
    wrap: Optional[Callable] = None

    @property
    def active(self):
        u = _uses.get(self.use)
        return u is not None and u.count > 0


class Patch:
    """One TensorFlow symbol (or family), its subscribers in order, innermost first."""

    def __init__(self, name, symbols, reason, order, optional_module=None):
        self.name = name
        self._symbols = symbols  # a list, or a function giving it (found at first use)
        self.reason = reason
        self.subscribers = [Subscriber(use, why) for use, why in order]
        self.optional_module = optional_module  # not installed if it cannot be imported
        self._saved = None  # [(symbol, own value, read value)] while installed
        self._replacements = {}  # id(symbol) -> what the patch put there
        self._forced = False  # installed by `install()`, whatever the uses
        self._found = False  # optional_module imported

    def __repr__(self):
        return "<Patch %s (%s%s): %s>" % (self.name, self.when,
                                          ", installed" if self.installed else "", self.reason)

    @property
    def symbols(self):
        if callable(self._symbols):
            self._symbols = list(self._symbols())
        return self._symbols

    @property
    def target(self):
        return ", ".join(repr(s) for s in self.symbols)

    @property
    def when(self):
        """The earliest time one of its uses starts ("runtime" before "first-use" before
        "scoped")."""
        whens = [_uses[s.use].when for s in self.subscribers if s.use in _uses]
        return min(whens, key=WHENS.index) if whens else "first-use"

    @property
    def installed(self):
        """How many of its subscribers are in place (0: TensorFlow's objects)."""
        return sum(1 for s in self.subscribers
                   if s.wrap is not None and (self._forced or _active(s.use)))

    def subscriber(self, use):
        for s in self.subscribers:
            if s.use == use:
                return s
        raise ValueError("tf_patches: patch %s declares no subscriber %r (its order: %s)"
                         % (self.name, use, [s.use for s in self.subscribers]))

    def _available(self):
        if self.optional_module is None or self._found:
            return True
        try:
            importlib.import_module(self.optional_module)
        except ImportError:
            return False
        self._found = True
        return True

    def apply(self):
        """Puts the composition of the active subscribers in place (TensorFlow's objects
        if none is active). Called under the registry lock."""
        self._forced = False
        uses = _uses
        self._compose([s for s in self.subscribers
                       if s.wrap is not None and uses[s.use].count > 0])

    def install(self):
        """Installs the patch with every subscriber, whether its use is active or not
        (tests: each patch installed and uninstalled on its own)."""
        with _lock:
            self._compose([s for s in self.subscribers if s.wrap is not None])
            self._forced = True

    def _compose(self, active):
        if not active:
            self.uninstall()
            return
        if not self._available():
            return
        if self._saved is None:
            self._saved = [(sym, sym.read_own(), sym.read()) for sym in self.symbols]
        primary = None
        ours = {id(v) for v in self._replacements.values()}
        for sym, own, value in self._saved:
            if sym.alias:
                # Only while it is still the primary's object (TensorFlow's, or one this
                # patch put in place): not while TensorFlow points it elsewhere.
                current = sym.read_own()
                if primary is not None and value is primary[0] and (
                        current is value or id(current) in ours):
                    sym.write(primary[1])
                continue
            fn = value
            for s in active:
                fn = s.wrap(fn)
            sym.write(fn)
            self._replacements[id(sym)] = fn
            if primary is None:
                primary = (value, fn)

    def uninstall(self):
        """Restores every symbol's own value (an alias TensorFlow has since pointed
        elsewhere stays as TensorFlow set it)."""
        self._forced = False
        if self._saved is None:
            return
        ours = {id(v) for v in self._replacements.values()}
        for sym, own, _ in reversed(self._saved):
            # (an alias: only if it holds one of the patch's functions, which TensorFlow
            # may have set itself: `execute.execute = quick_execute` when op callbacks go)
            if not sym.alias or id(sym.read_own()) in ours:
                sym.write(own)
        self._replacements.clear()
        self._saved = None


@dataclasses.dataclass
class Use:
    """One owner's need of patches, started at `when`: "runtime" (the first handler
    scope), "first-use" (`ensure`, then for good) or "scoped" (`acquire`/`release`,
    reference counted)."""

    name: str
    when: str
    reason: str
    count: int = 0

    @property
    def patches(self):
        """The patches it subscribes to (kept: scoped uses start and end often)."""
        found = _use_patches.get(self.name)
        if found is None:
            found = _use_patches[self.name] = [
                p for p in _patches.values() if any(s.use == self.name for s in p.subscribers)]
        return found


def _active(use):
    u = _uses.get(use)
    return u is not None and u.count > 0


def declare_use(name, when, reason):
    if when not in WHENS:
        raise ValueError("tf_patches: use %s has an unknown 'when' %r" % (name, when))
    with _lock:
        if name not in _uses:
            _uses[name] = Use(name, when, reason)
        return _uses[name]


def declare(name, symbols, reason, order, optional_module=None):
    """Declares the patch of one TensorFlow symbol (idempotent per name)."""
    with _lock:
        if name not in _patches:
            for use, _ in order:
                if use not in _uses:
                    raise ValueError("tf_patches: patch %s names undeclared use %r" % (name, use))
            _patches[name] = Patch(name, symbols, reason, order, optional_module)
            _use_patches.clear()
        return _patches[name]


@autograph_artifact  # (called from traced code: run as plain Python, not converted)
def subscribe(patch, use, wrap):
    """Fills `use`'s place on `patch` with `wrap(next) -> replacement`; if the use is
    active, the patch takes it now."""
    with _lock:
        p = _patches[patch]
        p.subscriber(use).wrap = wrap
        if _active(use):
            p.apply()


@autograph_artifact  # (called from traced code: run as plain Python, not converted)
def _start(use):
    for p in use.patches:
        p.apply()


@autograph_artifact  # (called from traced code: run as plain Python, not converted)
def ensure(name):
    """Starts use `name` for good (idempotent)."""
    use = _uses[name]
    if use.count:
        return
    with _lock:
        if not use.count:
            use.count = 1
            _start(use)


@autograph_artifact  # (called from traced code: run as plain Python, not converted)
def acquire(name):
    """Starts "scoped" use `name` for one more user (reference counted, so nested and
    concurrent users share one installation); pair with `release(name)`."""
    use = _uses[name]
    with _lock:
        use.count += 1
        if use.count == 1:
            _start(use)


@autograph_artifact  # (called from traced code: run as plain Python, not converted)
def release(name):
    """Ends one `acquire(name)`; the last user's release takes the use's wrappers out."""
    use = _uses[name]
    with _lock:
        use.count -= 1
        if use.count == 0:
            _start(use)


@autograph_artifact  # (called from traced code: run as plain Python, not converted)
def install_runtime():
    """Starts every "runtime" use (called once, when the dispatcher starts)."""
    with _lock:
        _runtime_started[0] = True
        for use in list(_uses.values()):
            if use.when == "runtime":
                ensure(use.name)


def uninstall_all():
    """Ends every use and restores every patched symbol (tests; the runtime starts its
    uses again with `install_runtime`)."""
    with _lock:
        for use in _uses.values():
            use.count = 0
        for p in reversed(list(_patches.values())):
            p.uninstall()
        _runtime_started[0] = False


def patches():
    """The declared patches, in declaration order."""
    return list(_patches.values())


def uses():
    """The declared uses (name -> Use)."""
    return dict(_uses)


class _Custom(Patch):
    """A patch given as install/uninstall functions (`register`), for a change that is no
    attribute of TensorFlow's; its one subscriber is the use of the same name."""

    def __init__(self, name, target, reason, install, uninstall):
        super().__init__(name, [], reason, [(name, reason)])
        self.subscribers[0].wrap = install
        self._target = target
        self._install, self._uninstall = install, uninstall
        self._on = False

    @property
    def target(self):
        return self._target

    def install(self):
        with _lock:
            if not self._on:
                self._install()
                self._on = True

    def apply(self):
        if _active(self.name):
            if not self._on:
                self._install()
                self._on = True
        else:
            self.uninstall()

    def uninstall(self):
        if self._on and self._uninstall is not None:
            self._uninstall()
            self._on = False


def register(name, target, reason, when, install, uninstall):
    """Registers a patch given as functions (idempotent per name) and the use of the same
    name that installs it; returns the patch. A patch of a TensorFlow attribute is
    declared in this folder instead, so that one patch owns each symbol."""
    if when not in WHENS:
        raise ValueError("tf_patches.register: unknown 'when' %r" % (when,))
    if when == "scoped" and uninstall is None:
        raise ValueError("tf_patches.register: scoped patch %s needs an uninstall" % name)
    with _lock:
        declare_use(name, when, reason)
        patch = _patches.get(name)
        if patch is None:
            patch = _patches[name] = _Custom(name, target, reason, install, uninstall)
            _use_patches.clear()
    if when == "runtime" and _runtime_started[0]:
        ensure(name)
    return patch
