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

Eviction drops the oldest insertion (cheap; a hit costs one dict lookup). With
``lru=True`` a hit also refreshes the entry, for caches whose entries are expensive to
rebuild (replayed functions). Reads and writes are safe from several threads (single
dict operations under the GIL; eviction takes a lock).
"""
import collections
import threading
import weakref

_all = weakref.WeakValueDictionary()  # name -> BoundedCache


class BoundedCache(collections.OrderedDict):
    """An insertion-ordered dict holding at most `maxsize` entries."""

    def __init__(self, name, maxsize, lru=False):
        super().__init__()
        if maxsize < 1:
            raise ValueError("BoundedCache %s: maxsize must be positive" % name)
        self.name = name
        self.maxsize = maxsize
        self.lru = lru
        self._lock = threading.Lock()
        _all[name] = self

    def __setitem__(self, key, value):
        with self._lock:
            super().__setitem__(key, value)
            if self.lru:
                self.move_to_end(key)
            while len(self) > self.maxsize:
                self.popitem(last=False)

    def get(self, key, default=None):
        value = super().get(key, _MISSING)
        if value is _MISSING:
            return default
        if self.lru:
            try:
                self.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        return value

    def setdefault(self, key, default=None):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            self[key] = default
            return default
        return value

    def __repr__(self):
        return "<BoundedCache %s: %d/%d>" % (self.name, len(self), self.maxsize)

    # OrderedDict's pickling/copy would lose name and size; caches are never copied.
    def __reduce__(self):
        raise TypeError("BoundedCache %s cannot be pickled" % self.name)


_MISSING = object()


def caches():
    """Every live cache of the package: ``{name: (entries, maxsize)}``."""
    return {name: (len(c), c.maxsize) for name, c in sorted(_all.items())}


def clear_all():
    """Empties every cache (tests; after changing TensorFlow's function library)."""
    for c in list(_all.values()):
        c.clear()
