"""C/C++ handler libraries that break the header's contracts.

The C++ boundary must turn each into a clear Python error naming the handler (and the op
where there is one), never a crash of the process or an unrelated error. Cases that
crashed run in a subprocess, so a regression fails the test instead of taking the test
session down. Libraries: tests/native/throwing_handler.cc, small_struct_handler.cc,
bad_name_handler.cc.
"""
import json
import pathlib
import sys
import textwrap

import pytest
from python_process import run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
NATIVE = ROOT / "tests" / "native"
sys.path.insert(0, str(NATIVE))

from test_native_handlers import build_handler_library  # noqa: E402  pylint: disable=wrong-import-position


def run_script(body, **libs):
    """Runs `body` in a fresh interpreter with `oh`, `tf` and the built libraries (paths
    in the dict LIBS) at hand; returns (returncode, stdout, stderr)."""
    paths = {k: build_handler_library(str(NATIVE / v)) for k, v in libs.items()}
    script = textwrap.dedent("""
        import json, gc, sys
        import tensorflow as tf
        import tf_ophandlers as oh
        LIBS = %r
    """) % (paths,) + textwrap.dedent(body)
    proc = run_python(script, timeout=300, check=False)
    return proc.returncode, proc.stdout, proc.stderr


# ---- a struct_size too small for the fields register_type reads ----------------

def test_too_small_struct_size_refuses_the_library():
    code, out, err = run_script("""
        try:
            lib = oh.load_handler_library(LIBS["tiny"])
            Tiny = lib.handler_types()["Tiny"]
            with Tiny():
                tf.sin(tf.constant([1.0]))
            print(json.dumps(["loaded"]))
        except BaseException as e:
            print(json.dumps([type(e).__name__, str(e)]))
    """, tiny="small_struct_handler.cc")
    assert code == 0, err[-3000:]
    kind, message = json.loads(out.splitlines()[-1])
    assert kind == "RuntimeError"
    assert "failed to load" in message and "struct_size 8" in message
    # (the type's name lies past its struct_size: the path names the library)
    assert "small_struct_handler" in message and "TFOH_HANDLER_TYPE_MIN_SIZE" in message


# ---- a C++ exception thrown by a hook ------------------------------------------

# Each case: (hook, Python statements that make the hook run with `h`, `x` and `f` in
# scope, whether the message names the op Sin).
HOOK_CASES = [
    ("create", "oh_cls('create')", False),
    ("execute", "with h: tf.sin(x)", True),
    ("execute_in_function", "with h: tf.function(lambda v: tf.sin(v) + 1.0)(x)", True),
    ("executes_op", "with h: tf.sin(x)", True),
    ("copy_on", "with h: tf.sin(x)", False),
    ("copy_off", "with h: y = tf.sin(x)\ny.numpy()", False),
    ("num_dims", "with h: y = tf.sin(x)\ny.shape.rank", False),
    ("dim", "with h: y = tf.sin(x)\ny.shape.as_list()", False),
    ("tensor_debug_string", "with h: y = tf.sin(x)\nrepr(y)", False),
    ("debug_string", "h.debug_string()", False),
    ("query", "h.query('k')", False),
    ("static_value", "with h: y = tf.sin(x)\ntf.get_static_value(y)", False),
    ("function_input_summary",
     "with h:\n    y = tf.sin(x)\n    tf.function(lambda v: v * 2.0)(y)", False),
    ("function_cache_key", "with h: tf.function(lambda v: v * 2.0)(x)", False),
    ("function_output", "with h: tf.function(lambda v: v * 2.0)(x)", False),
]


@pytest.mark.parametrize("thrown", ["std", "int"])
def test_hook_throwing_a_cxx_exception_is_a_handler_error(thrown):
    cases = [(hook, stmt, op) for hook, stmt, op in HOOK_CASES]
    code, out, err = run_script("""
        oh_cls = oh.load_handler_library(LIBS["lib"]).handler_types()["Throws"]
        x = tf.constant([[0.5, 1.0]])
        suffix = %r
        for hook, stmt, _ in %r:
            config = (hook[:-len("_in_function")] if hook.endswith("_in_function")
                      else hook) + suffix
            print("running", hook, file=sys.stderr, flush=True)
            try:
                h = None if hook == "create" else oh_cls(config)
                exec(stmt, {"tf": tf, "h": h, "x": x, "oh_cls": lambda c: oh_cls(c + suffix)})
                result = ["no error", ""]
            except BaseException as e:
                result = [type(e).__name__, str(e)]
            # The handler stays usable after the error (its state is not corrupted).
            if h is not None and hook not in ("copy_on", "executes_op"):
                with h:
                    z = tf.cos(x)
                result.append(bool(abs(z.numpy() - tf.cos(x).numpy()).max() < 1e-6)
                              if hook not in ("copy_off", "num_dims", "dim") else True)
            else:
                result.append(True)
            print(json.dumps([hook] + result), flush=True)
    """ % (":int" if thrown == "int" else "", cases), lib="throwing_handler.cc")
    assert code == 0, err[-3000:]
    results = {r[0]: r[1:] for r in map(json.loads, out.splitlines()) if r}
    assert sorted(results) == sorted(c[0] for c in HOOK_CASES)
    for hook, _, names_op in HOOK_CASES:
        kind, message, usable = results[hook]
        assert kind == "HandlerError", (hook, kind, message)
        name = hook[:-len("_in_function")] if hook.endswith("_in_function") else hook
        assert "Throws" in message and name in message, (hook, message)
        assert "C++ exception" in message, (hook, message)
        if thrown == "std":
            assert "%s blew up" % name in message, (hook, message)
        if names_op:
            assert "op Sin" in message, (hook, message)
        assert usable, hook


def test_delete_state_throwing_does_not_end_the_process():
    code, out, err = run_script("""
        Throws = oh.load_handler_library(LIBS["lib"]).handler_types()["Throws"]
        h = Throws("delete_state")
        with h:
            y = tf.sin(tf.constant([1.0]))
        del h, y
        gc.collect()
        print("alive")
    """, lib="throwing_handler.cc")
    assert code == 0, err[-3000:]
    assert out.split() == ["alive"]
    assert "delete_state" in err and "delete_state blew up" in err


# ---- a name and messages that are not valid UTF-8 -------------------------------

def test_non_utf8_handler_name_keeps_the_real_error():
    code, out, err = run_script("""
        types = oh.load_handler_library(LIBS["lib"]).handler_types()
        Bad = types["Caf\\ufffd"]
        x = tf.constant([1.0, 2.0])
        result = [Bad.__name__, Bad().debug_string()]
        with Bad():
            result.append(float(tf.reduce_sum(tf.cos(x))))
        for run in (lambda: tf.sin(x), lambda: tf.function(lambda v: tf.sin(v))(x)):
            try:
                with Bad():
                    run()
                result.append(["no error"])
            except BaseException as e:
                result.append([type(e).__name__, str(e)])
        print(json.dumps(result))
    """, lib="bad_name_handler.cc")
    assert code == 0, err[-3000:]
    name, debug, value, eager, function = json.loads(out.splitlines()[-1])
    assert name == "Caf\ufffd" and debug == "Caf\ufffd(\ufffd)"
    assert value == pytest.approx(float(sum(map(__import__("math").cos, [1.0, 2.0]))), rel=1e-6)
    for kind, message in (eager, function):
        assert kind == "InvalidArgumentError", message
        assert "Caf\ufffd refuses op Sin" in message


# ---- execute_next called from another thread than the hook's ----------------------

def test_execute_next_off_the_hook_thread_is_a_clear_error():
    code, out, err = run_script("""
        OffThread = oh.load_handler_library(LIBS["lib"]).handler_types()["OffThread"]
        x = tf.constant([0.5, 1.0])
        result = []
        for run in (lambda: tf.sin(x), lambda: tf.function(lambda v: tf.sin(v))(x)):
            try:
                with OffThread():
                    run()
                result.append(["no error"])
            except BaseException as e:
                result.append([type(e).__name__, str(e)])
        print(json.dumps(result))
    """, lib="throwing_handler.cc")
    assert code == 0, err[-3000:]
    eager, function = json.loads(out.splitlines()[-1])
    # The same error eagerly and in a replayed function (the differential rule).
    for kind, message in (eager, function):
        assert kind == "FailedPreconditionError", message
        assert "OffThread" in message and "op Sin" in message
        assert "execute_next" in message and "thread" in message
