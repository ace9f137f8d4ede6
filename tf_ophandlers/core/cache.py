"""`BoundedCache`: the one cache type of the package (every cache has a stated size).

A process-wide cache that grows with what user programs do (op signatures, function
names, tensor shapes) must be bounded, and must be keyed by everything its value depends
on. Every cache of the package is a `BoundedCache` with a name and a size, listed by
`caches()` (for tests and for users chasing memory):

>>> from tf_ophandlers.core.cache import BoundedCache
>>> c = BoundedCache("example", 2)
>>> c["a"] = 1; c["b"] = 2; c["c"] = 3
>>> list(c)
['b', 'c']

Eviction drops the oldest insertion (cheap; a hit costs one dict lookup). An
`LRUCache` also refreshes an entry on a hit, for entries that are expensive to rebuild
(replayed functions). Reads and writes are safe from several threads (single dict
operations under the GIL; insertion and eviction take a lock).
"""
import collections
import threading
import weakref

_all = weakref.WeakValueDictionary()  # name -> BoundedCache


class BoundedCache(collections.OrderedDict):
    """An insertion-ordered dict holding at most `maxsize` entries (the oldest go first).

    Lookups are OrderedDict's own (C) methods: caches on per-op paths pay nothing extra.
    """

    def __init__(self, name, maxsize):
        super().__init__()
        if maxsize < 1:
            raise ValueError("BoundedCache %s: maxsize must be positive" % name)
        self.name = name
        self.maxsize = maxsize
        # Reentrant: an evicted value's finalizer may touch the cache again.
        self._lock = threading.RLock()
        _all[name] = self

    def __setitem__(self, key, value):
        evicted = []
        with self._lock:
            super().__setitem__(key, value)
            self._touch(key)
            while len(self) > self.maxsize:
                evicted.append(self.popitem(last=False))
        del evicted  # evicted values are released outside the lock

    def _touch(self, key):
        pass

    def __repr__(self):
        return "<%s %s: %d/%d>" % (type(self).__name__, self.name, len(self), self.maxsize)

    # OrderedDict's pickling/copy would lose name and size; caches are never copied.
    def __reduce__(self):
        raise TypeError("%s %s cannot be pickled" % (type(self).__name__, self.name))


class LRUCache(BoundedCache):
    """A `BoundedCache` whose hits also refresh the entry (least recently used go first),
    for entries that are expensive to rebuild (replayed functions)."""

    def _touch(self, key):
        self.move_to_end(key)

    def get(self, key, default=None):
        value = super().get(key, _MISSING)
        if value is _MISSING:
            return default
        try:
            self.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
        return value


_MISSING = object()


_external = {}  # name -> () -> (entries, maxsize): caches kept outside Python (C++)


def register_external_cache(name, sizes):
    """Lists a cache kept outside Python (the C++ fast path's decisions) in `caches()`:
    ``sizes()`` returns ``(entries, maxsize)``."""
    _external[name] = sizes


def caches():
    """Every live cache of the package: ``{name: (entries, maxsize)}``.

    Examples:
        >>> entries, maxsize = next(iter(oh.caches().values()))
        >>> 0 <= entries <= maxsize
        True
    """
    out = {name: (len(c), c.maxsize) for name, c in _all.items()}
    out.update((name, tuple(sizes())) for name, sizes in _external.items())
    return dict(sorted(out.items()))


def clear_all():
    """Empties every BoundedCache (an entry may go at any time, so this changes no
    result): for a new eager context (dispatch.initialize), in which what they hold may
    not exist (functions registered in the old one, its tensors)."""
    for c in list(_all.values()):
        with c._lock:  # pylint: disable=protected-access
            c.clear()


class WeakRegistry:
    """key -> object held weakly, as a WeakValueDictionary without its per-entry Python
    (a KeyedRef made per insertion, a callback run per death): a scope per call makes
    and drops a stack, registered twice. Dead entries are swept when the dict has doubled."""

    __slots__ = ("_refs", "_limit")

    def __init__(self):
        self._refs = {}
        self._limit = 64

    def get(self, key):
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def __setitem__(self, key, value):
        refs = self._refs
        refs[key] = weakref.ref(value)
        if len(refs) > self._limit:
            for k, r in list(refs.items()):  # (a copy: other threads may insert)
                if r() is None and refs.get(k) is r:
                    refs.pop(k, None)
            self._limit = max(64, 2 * len(refs))

    def __len__(self):
        return len(self._refs)
