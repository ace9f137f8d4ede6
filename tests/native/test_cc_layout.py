"""The C++ sources' layout (cc/ in folders by layer) and its rules: the core layers name no
shipped handler (handler-specific C++ sits in cc/handlers/ and reaches the core only
through the fast path's hook slot, cc/fast/handler_hooks.h), the fast path's decision
kinds are named by what they do, and no function releases what it holds through a
`goto` cleanup (boundary/owners.h)."""
import inspect
import pathlib
import re

import pytest

import tf_ophandlers as oh
from tf_ophandlers.core import fast_decision
from tf_ophandlers.core.state import state

ROOT = pathlib.Path(__file__).resolve().parents[2]
CC = ROOT / "cc"
# Layer -> what it holds (docs/pending/cc44.md draws the same map).
LAYERS = {
    "boundary": "the module, dispatcher device, runtime state, status, Op, handler tensors",
    "fast": "the per-op fast path and its hook slot",
    "native": "the C/C++ handler ABI",
    "kernels": "op kernels: the copy ops and the op output plans",
    "c_api": "the C API without Python",
    "testing": "test-only devices",
    "handlers": "handler-specific C++, registered through the hook slot",
    "include": "the public headers",
}
CORE = ("boundary", "fast", "native", "kernels", "c_api")


def _sources(*folders):
    for folder in folders:
        for path in sorted((CC / folder).rglob("*")):
            if path.suffix in (".cc", ".h"):
                yield path


def _shipped_handler_names():
    return sorted(
        name for name, obj in vars(oh).items()
        if inspect.isclass(obj) and issubclass(obj, oh.OpHandler)
        and obj not in (oh.OpHandler, oh.NativeHandler))


def test_cc_is_in_folders_by_layer():
    loose = sorted(p.name for p in CC.iterdir() if p.is_file())
    assert not loose, "files directly in cc/: %s" % loose
    folders = sorted(p.name for p in CC.iterdir() if p.is_dir())
    assert folders == sorted(LAYERS), folders
    for folder in folders:
        assert any(_sources(folder)), "empty layer cc/%s" % folder


def test_core_layers_name_no_shipped_handler():
    names = _shipped_handler_names()
    assert {"Lazy", "Async", "GradientTape"} <= set(names)
    word = re.compile(r"\b(%s)\b" % "|".join(map(re.escape, names)))
    found = []
    paths = list(_sources(*CORE))
    assert len(paths) > 30, "the core layers' sources are not where this test reads them"
    for path in paths:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if '#include "handlers/' in line or word.search(line):
                found.append("%s:%d: %s" % (path.relative_to(ROOT), line_no, line.strip()))
    assert not found, "\n".join(found)


def test_decision_kinds_are_named_by_what_they_do():
    text = "\n".join(p.read_text() for p in _sources(*LAYERS))
    text += (ROOT / "tf_ophandlers" / "core" / "fast_decision.py").read_text()
    for old in ("FAST_LAZY", "FAST_RECORD", "kLazy", "kRecord", "RunRecord"):
        assert not re.search(r"\b%s\b" % old, text), old
    kinds = [fast_decision.FAST_PYTHON, fast_decision.FAST_FORWARD, fast_decision.FAST_NATIVE,
             fast_decision.FAST_HOOK, fast_decision.FAST_AFTER_EXECUTE,
             fast_decision.FAST_PLUGIN]
    assert kinds == list(range(6))  # the values cc/fast/fast_internal.h's Kind reads


@pytest.mark.requires_c_paths("the C++ path's decision kinds (off: all FAST_PYTHON)")
def test_shipped_handlers_get_the_generic_kinds():
    """oh.Lazy declares a C execute (FAST_PLUGIN, run through the hook slot); a tape's
    level forwards and then records (FAST_AFTER_EXECUTE); a plain hook is FAST_HOOK."""
    with oh.Lazy():
        assert fast_decision.fast_decision(state.current, "Sin")[0] == fast_decision.FAST_PLUGIN
    with oh.GradientTape():
        kind = fast_decision.fast_decision(state.current, "Sin")[0]
        assert kind == fast_decision.FAST_AFTER_EXECUTE

    class Hook(oh.OpHandler):
        def execute(self, op, inputs):  # (never run: only the decision is asked)
            return inputs

    with Hook():
        assert fast_decision.fast_decision(state.current, "Sin")[0] == fast_decision.FAST_HOOK


def test_handler_functions_reach_the_module_through_the_hook_slot():
    """cc/handlers/register.cc adds the handlers' setup functions to `_C` (the core's
    method tables no longer list them)."""
    for name in ("lazy_setup", "lazy_plan", "lazy_upstream", "lazy_computed", "async_setup",
                 "async_stats", "tape_setup", "tape_copy_setup"):
        assert callable(getattr(oh._C, name)), name  # pylint: disable=protected-access
    core = "\n".join(p.read_text() for p in _sources(*CORE))
    for name in ("lazy_setup", "async_setup", "tape_setup"):
        assert '"%s"' % name not in core, name


def test_no_goto_cleanups():
    found = ["%s:%d" % (p.relative_to(ROOT), n)
             for p in sorted(CC.rglob("*")) if p.suffix in (".cc", ".h")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bgoto\s+\w+\s*;", line.split("//")[0])]
    assert not found, found


def test_every_source_is_built():
    """Each .cc under cc/ is compiled by setup.py (the extensions) or the Makefile's C API
    library, or included by one that is (c_native_handlers.cc includes native_handlers.cc)."""
    built = (ROOT / "setup.py").read_text() + (ROOT / "Makefile").read_text()
    included = "\n".join(p.read_text() for p in sorted(CC.rglob("*.cc")))
    for path in sorted(CC.rglob("*.cc")):
        rel = str(path.relative_to(ROOT))
        assert rel in built or '#include "%s"' % str(path.relative_to(CC)) in included, rel
