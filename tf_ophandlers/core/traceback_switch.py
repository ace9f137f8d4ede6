"""TensorFlow's traceback-filtering switch, made explicit on a thread while its scope
places ops on the dispatcher.

`tf.debugging.is_traceback_filtering_enabled()` reads a thread-local attribute that only
`tf.debugging.enable_traceback_filtering()` / `disable_traceback_filtering()` set; until
then it answers True through ``getattr(local, "value", True)``, which raises and clears an
AttributeError inside Python on every call. TensorFlow's `filter_traceback` decorator
asks on every call of the APIs it wraps: an operator such as ``x * 1.01`` asks twice, and
under a recording handler (`oh.Lazy`) that missing attribute is a sizeable part of what
recording the op costs. While such a scope is open the attribute is set to the value its
absence means (True), so every answer stays the same, and it is removed when the scope
closes if it still holds the value set here (a program's own `disable_traceback_filtering()`
inside the scope is kept, as is any value set before the scope).
"""
from tensorflow.python.util import traceback_utils

# TensorFlow's thread-local switch; None if a TensorFlow version keeps it elsewhere (then
# nothing is set and every answer is TensorFlow's own).
_switch = getattr(traceback_utils, "_ENABLE_TRACEBACK_FILTERING", None)
_ABSENT = object()


def set_default():
    """Sets this thread's switch to its default (True) if no value is set; returns
    whether it did (the token `restore` takes)."""
    if _switch is None or getattr(_switch, "value", _ABSENT) is not _ABSENT:
        return False
    _switch.value = True
    return True


def restore(was_set):
    """Undoes `set_default()` (given its result) unless the program changed the switch
    since: a value the program set stays."""
    if was_set and getattr(_switch, "value", None) is True:
        del _switch.value
