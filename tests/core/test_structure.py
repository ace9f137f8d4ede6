"""The core's structure promises: import
without side effects, an acyclic import graph with no import back up, no private names
across handler modules, one subpackage per handler family, bounded caches, listed
patches, no history markers in source comments."""
import ast
import os
import pathlib
import io
import re
import sys
import tokenize

import pytest

import tf_ophandlers as oh

from python_process import run_python

PACKAGE = os.path.dirname(oh.__file__)
ROOT = os.path.dirname(PACKAGE)


def test_devices_configurable_after_import():
    out = run_python("""
        import tensorflow as tf
        import tf_ophandlers as oh
        from tensorflow.python.eager import context
        assert context.context()._context_handle is None, "import started the runtime"
        assert not any(p.installed for p in oh.patches()), oh.patches()
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        try:  # memory growth: plain TensorFlow's answer, whatever it is on this machine
            tf.config.experimental.set_memory_growth(cpu, True)
        except ValueError as e:
            assert "initialized" not in str(e), e
        assert len(tf.config.list_logical_devices("CPU")) == 2
        with oh.ParallelHandler(["/cpu:0", "/cpu:1"]) as p:
            x = p.pack([tf.constant(1.0), tf.constant(2.0)])
            y = x * 3.0
        print([float(t) for t in p.unpack(y)])
        print(sorted(q.name for q in oh.patches() if q.installed))
        from tf_ophandlers.core import tf_patches
        print(sorted(u.name for u in tf_patches.uses().values() if u.count))
    """)
    lines = out.strip().splitlines()
    assert lines[0] == "[3.0, 6.0]"
    assert "Context.device" in lines[1] and "record.could_possibly_record" not in lines[1]
    assert "Context.device" in lines[2] and "tape hooks" not in lines[2]


def test_import_leaves_tensorflow_unpatched():
    run_python("""
        import tensorflow as tf
        from tensorflow.python.eager import context
        from tensorflow.python.framework import func_graph, ops, tensor_util
        from tensorflow.python.eager import record
        before = (context.Context.device, ops.EagerTensor.__dict__.get("device"),
                  tensor_util.constant_value, func_graph.FuncGraph._create_op_internal,
                  record.record_operation)
        import tf_ophandlers as oh
        after = (context.Context.device, ops.EagerTensor.__dict__.get("device"),
                 tensor_util.constant_value, func_graph.FuncGraph._create_op_internal,
                 record.record_operation)
        assert before == after
        # Graph-op creation is patched only while a replay traces.
        f = tf.function(lambda a: tf.sin(a) * 2.0)
        with oh.OpLogHandler():
            f(tf.constant(1.0))
        assert func_graph.FuncGraph._create_op_internal is before[3]
    """)


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                yield rel[:-len(".__init__")] if rel.endswith(".__init__") else rel, path


def _imports(path, module):
    """(imported module, names) pairs of every import in the file, at any depth."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def _graph():
    modules = dict(_modules())
    graph = {}
    for name, path in modules.items():
        deps = set()
        for base, names in _imports(path, name):
            if not base.startswith("tf_ophandlers"):
                continue
            targets = [base + "." + n for n in names if base + "." + n in modules] or [base]
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def test_no_import_cycle_and_no_import_back_up():
    graph = _graph()
    for name, deps in graph.items():
        if name != "tf_ophandlers":
            assert "tf_ophandlers" not in deps, "%s imports the package's __init__" % name
    _assert_acyclic({n: deps - {"tf_ophandlers"} for n, deps in graph.items()})


def _assert_acyclic(graph):
    state = {}

    def visit(n, path):
        state[n] = "active"
        for d in sorted(graph[n]):
            assert state.get(d) != "active", "import cycle: " + " -> ".join(path + [d])
            if d not in state:
                visit(d, path + [d])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


@pytest.mark.parametrize("folder", ["benchmarks", "examples", "tests"])
def test_no_import_cycle_among_scripts(folder):
    """Scripts and test helpers import each other by bare module name (their folder is on
    sys.path): at any depth, no two of them import each other, directly or around."""
    paths = {}
    for root, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if f.endswith(".py"):
                paths.setdefault(f[:-3], os.path.join(root, f))
    graph = {}
    for name, path in paths.items():
        deps = set()
        for base, names in _imports(path, name):
            deps.update(n for n in (base, *(base + "." + m for m in names)) if n in paths)
            if not base:
                deps.update(n for n in names if n in paths)
        graph[name] = deps - {name}
    _assert_acyclic(graph)


def test_core_never_imports_handlers():
    for name, deps in _graph().items():
        if name.startswith("tf_ophandlers.core"):
            assert not any(d.startswith("tf_ophandlers.handlers") for d in deps), (name, deps)


def test_one_subpackage_per_handler_family():
    """handlers/ holds single-file handlers and one subpackage per handler family: no two
    of its top-level modules share a first word (`mesh.py` beside `mesh_rules.py`), and no
    module there is named after a family with a suffix (`mesh_rules.py` beside `mesh/`)."""
    handlers = os.path.join(PACKAGE, "handlers")
    names = sorted(f[:-3] if f.endswith(".py") else f for f in os.listdir(handlers)
                   if (f.endswith(".py") and f != "__init__.py")
                   or os.path.isfile(os.path.join(handlers, f, "__init__.py")))
    assert "gradient_tape" in names and "async_execution" in names, names
    first = {}
    for n in names:
        first.setdefault(n.split("_")[0], []).append(n)
    families = {k: v for k, v in first.items() if len(v) > 1}
    assert not families, "prefix families in handlers/ (make each a subpackage): %s" % families
    for n in names:
        assert not any(n.startswith(m + "_") for m in names if m != n), n
    for n in names:
        package = os.path.join(handlers, n)
        if os.path.isdir(package):
            assert os.path.isfile(os.path.join(package, "handler.py")), (
                "%s/ has no handler.py (the family's handler class)" % n)


# Markers of a project's history rather than of the code's reasons: review and branch
# round names, issue numbers and titles, dates, commit hashes. They belong in CHANGELOG.md.
_HISTORY = re.compile(
    r"\b(?:review|vmap|fuzz|round)\d+\b|\bissues? #?\d+|\bissue \"|\b20\d\d-\d\d-\d\d\b"
    r"|\b(?:on main|fails on|commit) [0-9a-f]{7,40}\b|\b(?:speed|review|this) round\b",
    re.I)


def _comments_and_docstrings(path):
    """(line, text) of every comment and docstring of a Python file."""
    source = open(path, encoding="utf-8").read()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno, doc)


def test_no_history_markers_in_source_comments():
    """Comments and docstrings say why, not when or in which round: no round names,
    issue numbers, dates or commit hashes in the package, the C++ sources, the tests and
    the benchmarks (their printed reports may cite them: those are documents)."""
    found = []
    for folder in ("tf_ophandlers", "cc", "tests", "benchmarks", "examples"):
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                path = os.path.join(root, f)
                rel = os.path.relpath(path, ROOT)
                if f.endswith(".py"):
                    texts = _comments_and_docstrings(path)
                elif f.endswith((".cc", ".h", ".c")) and not rel.startswith("tf_ophandlers"):
                    texts = enumerate(open(path, encoding="utf-8").read().splitlines(), 1)
                else:
                    continue
                for line, text in texts:
                    for m in _HISTORY.finditer(text):
                        found.append("%s:%d: %s" % (rel, line, m.group(0)))
    assert not found, "history markers (move them to CHANGELOG.md):\n" + "\n".join(found)


def test_handlers_use_no_private_names_of_other_modules():
    modules = dict(_modules())
    for name, path in modules.items():
        if not name.startswith("tf_ophandlers.handlers"):
            continue
        tree = ast.parse(open(path).read())
        aliases = {}
        for base, names in _imports(path, name):
            if base.startswith("tf_ophandlers"):
                for n in names:
                    assert not n.startswith("_"), "%s imports %s.%s" % (name, base, n)
                assert not base.rpartition(".")[2].startswith("_"), (name, base)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tf_ophandlers"):
                for a in node.names:
                    if node.module + "." + a.name in modules:
                        aliases[a.asname or a.name] = node.module + "." + a.name
                    elif node.module == "tf_ophandlers.extend":
                        # A module the author API passes on (ox.scope, ox.errors, ...).
                        from tf_ophandlers import extend
                        target = getattr(extend, a.name, None)
                        if getattr(target, "__name__", None) in modules and isinstance(
                                target, type(extend)):
                            aliases[a.asname or a.name] = target.__name__
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")):
                pytest.fail("%s uses %s.%s" % (name, aliases[node.value.id], node.attr))


def test_caches_are_bounded_and_listed():
    from tf_ophandlers.core.cache import BoundedCache
    c = BoundedCache("test.structure", 3)
    for i in range(10):
        c[i] = i
    assert list(c) == [7, 8, 9]
    listed = oh.caches()
    assert listed["test.structure"] == (3, 3)
    assert {"functions.replays", "functions.bodies", "dispatch.python_scalars"} <= set(listed)
    assert all(0 <= n <= size for n, size in listed.values())


def test_patches_name_their_reason():
    names = [p.name for p in oh.patches()]
    assert len(names) == len(set(names))
    for p in oh.patches():
        assert p.reason and p.target and p.when in ("runtime", "scoped", "first-use")


def test_the_guides_patch_table_lists_every_patch():
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    missing = [p.name for p in oh.patches() if p.name not in rows]
    assert not missing, "docs/architecture.md's patch table lacks %s" % missing


def test_ops_and_stacks_start_the_runtime_without_a_scope():
    run_python("""
        import tensorflow as tf
        import tf_ophandlers as oh
        op = oh.Op.create("AddV2", T=tf.float32)   # the guide's example, before any scope
        print(oh.PHYSICAL.execute(op, [tf.constant(1.), tf.constant(2.)])[0].numpy())
        stack = oh.HandlerStack.merged(oh.OpLogHandler(), oh.PHYSICAL)
        t = stack.copy_on(tf.constant([1.0]))
        assert oh.handler_of(t) is stack and t.numpy().tolist() == [1.0]
        try:
            oh.handler("not a handler")
        except TypeError:
            pass
    """)


def test_no_handler_module_defines_its_own_elementwise_op_list():
    """core/op_kinds.py holds the one table of elementwise op types: a handler module
    with a literal list of them (a tuple, list, set or a split string) would let the
    tables drift apart again."""
    from tf_ophandlers.core.op_kinds import ELEMENTWISE
    for name, path in _modules():
        if not name.startswith("tf_ophandlers.handlers"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = []
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in node.elts
                         if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = node.value.split()
            found = sorted(set(names) & ELEMENTWISE)
            # A few elementwise names among others (forward_accumulator's linear ops, its
            # real-only *Grad rules) state another property; a list of mostly elementwise
            # ops is a copy of the table.
            assert len(found) < 10 or 2 * len(found) <= len(set(names)), (
                "%s:%d lists elementwise ops %s: use core/op_kinds.py" % (
                    name, node.lineno, found))


def _handler_family(module):
    """The family a module under handlers/ belongs to: ``("gradient_tape", True)`` for a
    module of the subpackage handlers/gradient_tape/, ``("op_log", False)`` for the
    single-file handler handlers/op_log.py, None for handlers/__init__.py."""
    parts = module.split(".")[2:]
    if not parts:
        return None
    is_package = os.path.isdir(os.path.join(PACKAGE, "handlers", parts[0]))
    return parts[0], is_package


def test_handlers_import_the_package_only_through_extend():
    """A handler module imports tf_ophandlers only as `tf_ophandlers.extend` (the author
    API) and, in a family's subpackage, that subpackage: what families need of each other
    is a declaration on OpHandler or a table of core/registries.py, not an import."""
    found = []
    for name, path in _modules():
        if not name.startswith("tf_ophandlers.handlers"):
            continue
        family = _handler_family(name)
        own = None if family is None or not family[1] else "tf_ophandlers.handlers." + family[0]
        for base, names in _imports(path, name):
            if not base.startswith("tf_ophandlers"):
                continue
            if base == "tf_ophandlers.extend" or (base == "tf_ophandlers" and names == ("extend",)):
                continue
            if own is not None and (base == own or base.startswith(own + ".")):
                continue
            found.append("%s imports %s%s" % (name, base, " (%s)" % ", ".join(names) if names else ""))
    assert not found, "handlers import the package only through tf_ophandlers.extend:\n" + (
        "\n".join(found))


def _shipped_handler_names():
    """The names by which code would know a shipped handler: the handler classes and
    functions the package exports from handlers/, every OpHandler subclass defined there,
    the families' module names, and the op types handlers record on TensorFlow's tapes."""
    import inspect
    classes = set()
    for attr in dir(oh):
        obj = getattr(oh, attr)
        if getattr(obj, "__module__", "").startswith("tf_ophandlers.handlers"):
            classes.add(attr)
    for name, _ in _modules():
        if name.startswith("tf_ophandlers.handlers."):
            module = sys.modules.get(name)
            for attr, obj in vars(module or object).items():
                if (inspect.isclass(obj) and issubclass(obj, oh.OpHandler)
                        and obj.__module__ == name):
                    classes.add(attr)
    handlers = os.path.join(PACKAGE, "handlers")
    families = {f[:-3] if f.endswith(".py") else f for f in os.listdir(handlers)
                if f != "__init__.py" and not f.startswith("__")}
    # Words that are TensorFlow's or the RFC's vocabulary as much as a family's name
    # (tf.function tracing, the RFC's parallel pack ops, core's substitute rule slot).
    families -= {"trace", "parallel", "substitutes"}
    # Op types of a handler's own: recorded with record_operation(<literal>, ...) or
    # named by a module constant `*_OP_TYPE`.
    op_types = set()
    for name, path in _modules():
        if not name.startswith("tf_ophandlers.handlers."):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Call) and node.args
                    and getattr(node.func, "attr", getattr(node.func, "id", None))
                    == "record_operation" and isinstance(node.args[0], ast.Constant)):
                op_types.add(node.args[0].value)
            elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str) and any(
                      isinstance(t, ast.Name) and t.id.endswith("_OP_TYPE")
                      for t in node.targets)):
                op_types.add(node.value.value)
    return classes, families, op_types


# The C++ fast path's handler-specific entry points that core/fast_decision.py passes on
# under the extension's names, until cc/ registers handler-specific C++ through one hook
# slot: the names are the C extension's, not a Python decision of core.
_C_BRIDGE_NAMES = frozenset(("lazy_record_setup", "lazy_setup", "lazy_plan", "lazy_upstream",
                             "lazy_computed"))


def test_core_names_no_shipped_handler():
    """core/ (Python) knows no shipped handler: no identifier, attribute, import or string
    in its code (docstrings and comments aside: they may give examples) names a shipped
    handler class, a handler family or an op type a handler records. A need of one
    handler that core serves is a declaration on OpHandler or a registry a handler fills."""
    classes, families, op_types = _shipped_handler_names()
    assert {"GradientTape", "VectorizedMap", "Lazy", "Mesh"} <= classes, classes
    assert {"gradient_tape", "recompute", "lazy"} <= families, families
    assert "RecomputeSegment" in op_types, op_types
    # In strings (messages, patch reasons): `oh.<name>` or a handler's op type; a bare
    # "GradientTape" may be TensorFlow's (tf.GradientTape).
    class_words = re.compile(r"\boh\.(%s)\b|\b(%s)\b" % (
        "|".join(sorted(classes)), "|".join(sorted(op_types))))
    found = []
    for name, path in _modules():
        if not name.startswith("tf_ophandlers.core"):
            continue
        tree = ast.parse(open(path).read())
        docstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)) and node.body and isinstance(
                                     node.body[0], ast.Expr) and isinstance(
                                         node.body[0].value, ast.Constant):
                docstrings.add(id(node.body[0].value))
        for node in ast.walk(tree):
            words = []
            if isinstance(node, ast.Name):
                words = [node.id]
            elif isinstance(node, ast.Attribute):
                words = [node.attr]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                words = [node.name]
            elif isinstance(node, ast.alias):
                words = [node.name, node.asname or ""]
            elif isinstance(node, ast.ImportFrom):
                words = [node.module or ""]
            strings = []
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings):
                strings = [node.value]
            for word in words:
                if word in _C_BRIDGE_NAMES:
                    continue
                bare = word.strip("_")
                hit = any(bare == f or bare.startswith(f + "_") or bare.endswith("_" + f)
                          or "." + f in word for f in families) or (
                    {word} & classes) or word.startswith("tf_ophandlers.handlers")
                if hit:
                    found.append("%s:%d: %s" % (name, node.lineno, word))
            for text in strings:
                m = class_words.search(text)
                if m or "tf_ophandlers.handlers" in text:
                    found.append("%s:%d: %r" % (name, node.lineno, text[:80]))
    assert not found, "core names shipped handlers:\n" + "\n".join(sorted(set(found)))


def test_the_author_api_documents_every_name():
    """`tf_ophandlers.extend` is the handler author's API: each of its names is
    documented in its module docstring, and exists."""
    from tf_ophandlers import extend
    doc = extend.__doc__
    missing = [n for n in extend.__all__ if "`%s" % n not in doc]
    assert not missing, "tf_ophandlers.extend's docstring does not document %s" % missing
    assert all(hasattr(extend, n) for n in extend.__all__)
    assert len(set(extend.__all__)) == len(extend.__all__)
