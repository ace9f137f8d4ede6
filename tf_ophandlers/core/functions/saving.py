"""Saving: a function whose body depends on a live handler cannot be saved (RFC
"Relationship to SavedModels")."""
from tf_ophandlers.core import errors
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.stack import stack_of


def _name(function):
    name = function.name
    return name.decode() if isinstance(name, bytes) else name


def _check_saveable(saveable_view):
    """Refuses to save a function whose body depends on a live handler (RFC
    "Relationship to SavedModels": a handler scope opened while tracing, or a captured
    handler tensor). Functions called under handlers save as they are."""
    for function in getattr(saveable_view, "concrete_functions", ()):
        for t in getattr(function, "captured_inputs", ()):
            s = stack_of(t)
            if s is not None:
                raise errors.HandlerError(
                    "tf_ophandlers: cannot save function %s: its body depends on the live "
                    "handler stack %r (a handler scope opened while tracing it, or a "
                    "captured handler tensor). Save the function without handlers and "
                    "apply them around the call after loading." % (_name(function), s))


def _wrap_fill_meta_graph_def(original):
    def _fill_meta_graph_def(meta_graph_def, saveable_view, *args, **kwargs):
        _check_saveable(saveable_view)
        return original(meta_graph_def, saveable_view, *args, **kwargs)
    return _fill_meta_graph_def


tf_patches.subscribe("save._fill_meta_graph_def", "save._fill_meta_graph_def",
                     _wrap_fill_meta_graph_def)
