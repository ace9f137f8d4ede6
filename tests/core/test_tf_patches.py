"""The patches of TensorFlow: all in core/tf_patches/, one per TensorFlow symbol, each
removable, subscribers in their declared order."""
import ast
import os
import sys
import textwrap
import types

import pytest

import tf_ophandlers as oh
from tf_ophandlers.core import tf_patches

from python_process import run_python

PACKAGE = os.path.dirname(oh.__file__)
FOLDER = os.path.join("core", "tf_patches")


# -- (a) no TensorFlow attribute is assigned outside the folder -----------------------------

_TF_ROOTS = ("tensorflow", "keras", "tf_keras")


def _tf_names(tree):
    """Names bound in the file to TensorFlow or Keras modules, classes or functions:
    imports, and aliases of their attributes (`cls = trainer.TensorFlowTrainer`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _TF_ROOTS:
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] in _TF_ROOTS:
            names.update(a.asname or a.name for a in node.names)
    changed = True
    while changed:  # aliases of aliases
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _root(node.value) in names:
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id not in names:
                        names.add(t.id)
                        changed = True
    return names


def _root(node):
    """The name an attribute chain (`a.b.c`) starts from, or None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


# What a module sets on its own functions (`run.__doc__ = fn.__doc__`).
_FUNCTION_DATA = frozenset(("__doc__", "__name__", "__qualname__", "__module__", "__wrapped__",
                            "__signature__", "__annotations__", "__defaults__", "__kwdefaults__"))


def tf_attribute_assignments(path):
    """(line, source) of each assignment to an attribute of a TensorFlow or Keras module
    or class in the file (`x.attr = ...`, `setattr(x, ...)`, `delattr(x, ...)`)."""
    source = open(path).read()
    tree = ast.parse(source)
    names = _tf_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args
              and _root(node.args[0]) in names):
            found.append((node.lineno, ast.get_source_segment(source, node)))
        for t in targets:
            for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                # (a class's special method assigned from outside it: the class is not the
                # module's own, which would define it in its body)
                if isinstance(e, ast.Attribute) and (_root(e) in names or (
                        e.attr.startswith("__") and e.attr.endswith("__")
                        and e.attr not in _FUNCTION_DATA)):
                    found.append((node.lineno, ast.get_source_segment(source, e)))
    return found


def test_the_attribute_check_sees_each_form(tmp_path):
    code = textwrap.dedent("""
        import tensorflow as tf
        from tensorflow.python.eager import record as _record
        def install():
            from keras.src.optimizers import base_optimizer
            cls = base_optimizer.BaseOptimizer
            cls.apply = None
            _record.record_operation = None
            tf.handler = None
            setattr(tf, "x", 1)
            t = tf.constant(1.0)          # an instance: not a module or class
            self_like = object()
            self_like.attr = 1
        def wrap_new(cls):
            cls.__new__ = None            # some class's special method, from outside it
    """)
    # (not beside the tests: a concurrent test walking tests/ would see it come and go)
    path = str(tmp_path / "_tmp_patch_probe.py")
    with open(path, "w") as f:
        f.write(code)
    found = sorted(line for line, _ in tf_attribute_assignments(path))
    assert found == [7, 8, 9, 10, 15], found


def test_no_module_outside_the_folder_assigns_tensorflow_attributes():
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        rel_root = os.path.relpath(root, PACKAGE)
        if rel_root == FOLDER or rel_root.startswith(FOLDER + os.sep) \
                or rel_root.startswith(FOLDER):  # (also a module core/tf_patches.py)
            continue
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_root, f))
            if rel.startswith(FOLDER):
                continue
            for line, text in tf_attribute_assignments(os.path.join(root, f)):
                offenders.append("%s:%d %s" % (rel, line, text))
    assert not offenders, "assignments to TensorFlow attributes outside %s/:\n%s" % (
        FOLDER, "\n".join(offenders))


# -- (b) one patch per TensorFlow symbol; (2) every patch removable --------------------------

_SNAPSHOT = """
import operator, sys, types
import tensorflow as tf
import tf_ophandlers as oh
from tf_ophandlers.core import tf_patches
with oh.OpHandler():  # the dispatcher exists (the fast-path patch needs it) ...
    pass
tf_patches.uninstall_all()  # ... and TensorFlow is as it was before the first scope
for name in ("keras.src.backend.tensorflow.trainer", "keras.src.losses.loss",
             "keras.src.optimizers.base_optimizer", "keras.src.backend.tensorflow.optimizer"):
    try:
        __import__(name)
    except ImportError:
        pass

def _same_dict(a, b):
    # C-speed check that two dicts hold the same objects under the same keys; a dict whose
    # keys moved is compared key by key.
    return len(a) == len(b) and all(map(operator.is_, a, b)) and \
        all(map(operator.is_, a.values(), b.values()))

_class_lists = {}  # module name -> (its dict copy, the TF/Keras classes it holds)

def snapshot():
    # Every attribute of every TensorFlow and Keras module, and the own attributes of
    # every class they define: where -> copy of its __dict__ (holding the objects, so
    # that identity is compared, never a reused id).
    out, seen = {}, set()
    for mname, module in list(sys.modules.items()):
        if not mname.split(".")[0] in ("tensorflow", "keras") or \
                not isinstance(module, types.ModuleType):
            continue
        try:
            d = dict(vars(module))
        except TypeError:
            continue
        out.setdefault(mname, {}).update(d)
        cached = _class_lists.get(mname)
        if cached is not None and _same_dict(cached[0], d):
            classes = cached[1]
        else:
            classes = [v for v in d.values() if isinstance(v, type) and
                       (getattr(v, "__module__", "") or "").split(".")[0] in ("tensorflow", "keras")]
            _class_lists[mname] = (d, classes)
        for v in classes:
            if id(v) not in seen:
                seen.add(id(v))
                out.setdefault(v.__module__ + "." + v.__qualname__, {}).update(vars(v))
    return out

_MISSING = object()

def diff(a, b):
    keys = []
    for where, bd in b.items():
        ad = a.get(where)
        if ad is None:
            keys.extend((where, k) for k in bd)
        elif not _same_dict(ad, bd):
            keys.extend((where, k) for k, v in bd.items() if ad.get(k, _MISSING) is not v)
            keys.extend((where, k) for k in ad if k not in bd)
    for where, ad in a.items():
        if where not in b:
            keys.extend((where, k) for k in ad)
    return sorted("%s.%s" % k for k in keys)
"""


@pytest.fixture(scope="module")
def patch_by_patch():
    """Each patch installed and uninstalled on its own, in a fresh process: what each
    changed (SHARED: an attribute two patches changed), and what stayed changed after
    every uninstall (LEFT; NO UNINSTALL for a patch without one)."""
    return run_python(_SNAPSHOT + """
base = previous = snapshot()
changed_by = {}
for p in oh.patches():
    p.install()
    now = snapshot()
    for k in diff(previous, now):
        changed_by.setdefault(k, []).append(p.name)
    if callable(p.uninstall):
        p.uninstall()
    else:
        print("NO UNINSTALL", p.name)
        previous = now
for k, names in sorted(changed_by.items()):
    if len(names) > 1:
        print("SHARED", k, names)
print("LEFT", diff(base, snapshot()))
print("CHANGED", len(changed_by))
""")


def test_each_tensorflow_attribute_is_changed_by_one_patch(patch_by_patch):
    shared = [line for line in patch_by_patch.splitlines() if line.startswith("SHARED")]
    assert not shared, "\n".join(shared)
    changed = int(patch_by_patch.split("CHANGED")[-1])
    assert changed >= len(oh.patches()) - 2  # (the registrations in C are no attributes)


def test_every_patch_uninstalls_to_tensorflows_objects(patch_by_patch):
    missing = [line for line in patch_by_patch.splitlines() if line.startswith("NO UNINSTALL")]
    assert not missing, "\n".join(missing)
    assert "LEFT []" in patch_by_patch, patch_by_patch[-3000:]


def test_patch_symbols_are_distinct_and_resolve():
    seen = {}
    for p in tf_patches.patches():
        for sym in p.symbols:
            key = repr(sym)
            assert key not in seen, "%s is patched by %s and %s" % (key, seen[key], p.name)
            seen[key] = p.name
            if isinstance(sym, tf_patches.Symbol) and p.optional_module is None \
                    and p.name != "tf.handler":
                assert sym.read() is not None, sym
        assert p.subscribers, p.name
        for s in p.subscribers:
            assert s.use in tf_patches.uses() and s.why, (p.name, s)
            assert s.wrap is not None, "%s: %s never subscribed" % (p.name, s.use)


def test_the_removal_restores_each_symbols_object():
    """Each symbol, not only the snapshot: the object TensorFlow had before, and a class
    attribute TensorFlow's class inherited is inherited again (not copied onto it)."""
    run_python("""
        import tensorflow as tf
        import tf_ophandlers as oh
        from tf_ophandlers.core import tf_patches
        with oh.OpHandler():
            pass
        tf_patches.uninstall_all()
        for p in oh.patches():
            if p.optional_module is not None:
                try:
                    __import__(p.optional_module)
                except ImportError:
                    continue
            before = [(s, s.read_own()) for s in p.symbols]
            p.install()
            assert p.installed, p
            assert any(s.read_own() is not own for s, own in before if not s.alias) \\
                or p.name.startswith("registered"), p
            p.uninstall()
            assert not p.installed, p
            for s, own in before:
                assert s.read_own() is own, (p.name, s)
        print("ok")
    """)


# -- (c) subscribers in their declared order --------------------------------------------------

@pytest.fixture
def probe_patch():
    module = types.ModuleType("oh_patch_probe")

    def original(trace):
        trace.append("original")
        return trace

    module.target = original
    sys.modules[module.__name__] = module
    from tf_ophandlers.core.tf_patches import registry
    for use in ("probe inner", "probe middle", "probe outer"):
        registry.declare_use(use, "scoped", "test")
    patch = registry.declare("probe.target", [registry.Symbol(module.__name__, "target")],
                             "test", [("probe inner", "first"), ("probe middle", "second"),
                                      ("probe outer", "last")])
    try:
        yield module, original, patch
    finally:
        patch.uninstall()
        del registry._patches["probe.target"]  # pylint: disable=protected-access
        registry._use_patches.clear()  # pylint: disable=protected-access
        for use in ("probe inner", "probe middle", "probe outer"):
            del registry._uses[use]  # pylint: disable=protected-access
        del sys.modules[module.__name__]


def _tracing(label):
    def wrap(next_fn):
        def fn(trace):
            trace.append(label)
            return next_fn(trace)
        return fn
    return wrap


def test_subscribers_run_in_the_declared_order_whatever_the_start_order(probe_patch):
    module, original, patch = probe_patch
    # Subscribed and started outermost first: the declared order still decides.
    for use in ("probe outer", "probe middle", "probe inner"):
        tf_patches.subscribe("probe.target", use, _tracing(use))
    tf_patches.acquire("probe outer")
    assert module.target([]) == ["probe outer", "original"]
    tf_patches.acquire("probe inner")
    assert module.target([]) == ["probe outer", "probe inner", "original"]
    tf_patches.acquire("probe middle")
    assert module.target([]) == ["probe outer", "probe middle", "probe inner", "original"]
    assert patch.installed == 3
    tf_patches.release("probe middle")
    assert module.target([]) == ["probe outer", "probe inner", "original"]
    tf_patches.release("probe outer")
    tf_patches.release("probe inner")
    assert module.target is original and not patch.installed


def test_an_undeclared_subscriber_is_refused(probe_patch):
    with pytest.raises(ValueError, match="declares no subscriber 'someone else'"):
        tf_patches.subscribe("probe.target", "someone else", _tracing("x"))


def test_record_operation_subscribers_nest_in_the_declared_order():
    """The tape hooks started before the runtime (an oh.GradientTape before any other
    scope) still wrap the call records, and the Recompute windows wrap both."""
    run_python("""
        from tensorflow.python.eager import record
        original = record.record_operation
        import tf_ophandlers as oh
        from tf_ophandlers.core import tf_patches
        from tf_ophandlers.core.functions import call_records
        from tf_ophandlers.handlers.gradient_tape import hooks
        from tf_ophandlers.handlers.recompute import graph
        tf_patches.ensure("recompute graph records")
        tf_patches.ensure("tape hooks")
        tf_patches.install_runtime()
        assert graph._previous["record_operation"] is hooks._record_operation
        assert hooks._original_record_operation[0] is call_records._record_operation
        assert call_records._previous[0] is original
        assert record.record_operation.__module__ == graph.__name__
        print([s.use for s in tf_patches.patches()[0].subscribers])
    """)


def test_quick_execute_subscribers_nest_in_the_declared_order():
    run_python("""
        from tensorflow.python.eager import execute
        original = execute.quick_execute
        import tf_ophandlers as oh
        from tf_ophandlers.core import tf_patches
        from tf_ophandlers.core.functions import call
        tf_patches.install_runtime()
        assert execute.quick_execute is call._scope_execute
        assert execute.execute is call._scope_execute     # (the alias follows)
        assert call._quick_execute is not original        # the status conversion between
        assert call._quick_execute.__name__ == original.__name__
        # Op callbacks point `execute` elsewhere: a new composition leaves it there,
        # and TensorFlow's reset to quick_execute finds the patch's function.
        from tensorflow.python.framework import op_callbacks
        callback = lambda *args, **kwargs: None
        op_callbacks.add_op_callback(callback)
        assert execute.execute is execute.execute_with_callbacks
        patch = {p.name: p for p in oh.patches()}["execute.quick_execute"]
        patch.apply()
        assert execute.execute is execute.execute_with_callbacks
        op_callbacks.remove_op_callback(callback)
        assert execute.execute is execute.quick_execute is call._scope_execute
        for p in oh.patches():
            p.uninstall()
        assert execute.quick_execute is original and execute.execute is original
    """)
