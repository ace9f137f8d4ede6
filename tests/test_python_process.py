"""tests/python_process.run_python: a run forked from the server (which has imported
TensorFlow) behaves as the same run in a fresh interpreter, which `fresh=True` gives."""
import os
import pathlib
import signal

import pytest

from python_process import run_python

_PROBE = """
import atexit, os, sys, threading, time
print("name", __name__)
print("argv", sys.argv)
print("path0", repr(sys.path[0]))
print("stdin", repr(sys.stdin.read()))
print("preloaded", "tensorflow" in sys.modules)
print("package", "tf_ophandlers" in sys.modules)
def late():
    time.sleep(0.2)
    print("thread joined", flush=True)
threading.Thread(target=late).start()
atexit.register(lambda: print("atexit ran"))
sys.stderr.write("to stderr\\n")
"""


def _lines(out):
    return [l for l in out.splitlines() if not l.startswith("preloaded")]


def test_a_forked_run_prints_what_a_fresh_run_prints():
    forked = run_python(_PROBE, args=["a", 1], check=False)
    fresh = run_python(_PROBE, args=["a", 1], check=False, fresh=True)
    assert forked.returncode == fresh.returncode == 0
    assert _lines(forked.stdout) == _lines(fresh.stdout)
    assert "name __main__" in fresh.stdout and "argv ['-c', 'a', '1']" in fresh.stdout
    assert fresh.stdout.splitlines()[-2:] == ["thread joined", "atexit ran"]
    assert forked.stderr.strip() == fresh.stderr.strip() == "to stderr"
    assert "preloaded True" in forked.stdout and "preloaded False" in fresh.stdout
    assert "package False" in forked.stdout


def test_a_forked_run_has_no_eager_context_yet():
    # Devices can still be configured: the server ran no op.
    out = run_python("""
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        print(len(tf.config.list_logical_devices("CPU")))
    """)
    assert out.split() == ["2"]


# (What `python -c` gives for each; a fresh interpreter per case would cost seconds each.)
@pytest.mark.parametrize("code, returncode, stderr", [
    ("import sys; sys.exit(3)", 3, ""),
    ("raise SystemExit('stopped here')", 1, "stopped here"),
    ("def f():\n    raise KeyError('k')\nf()", 1, "KeyError: 'k'"),
    ("import os; os.abort()", -signal.SIGABRT, ""),
], ids=["exit_3", "exit_message", "exception", "abort"])
def test_exit_statuses_are_a_fresh_processs(code, returncode, stderr):
    proc = run_python(code, check=False)
    assert proc.returncode == returncode, proc.stderr
    assert stderr in proc.stderr
    if stderr.startswith("KeyError"):
        assert "Traceback (most recent call last)" in proc.stderr


def test_a_script_runs_as_main_with_its_directory_first_on_the_path(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(__name__, __file__ == sys.argv[0], sys.path[0], sys.argv[1:])\n")
    assert run_python(pathlib.Path(script), args=["x"]) == "__main__ True %s ['x']\n" % tmp_path


def test_a_hung_run_fails_the_test_and_the_next_run_works():
    with pytest.raises(pytest.fail.Exception, match="hung: no exit in 2 s.*before the hang"):
        run_python("print('before the hang', flush=True)\nimport time\ntime.sleep(60)",
                   timeout=2)
    assert run_python("print('next')") == "next\n"


def test_another_environment_has_its_own_server():
    # TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, at its import: here in the server of
    # that environment (a later change of os.environ would not be seen).
    code = """
        import os, sys
        from tensorflow.python.util import _pywrap_util_port
        print("tensorflow" in sys.modules, os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
              _pywrap_util_port.IsMklEnabled())
    """
    assert run_python(code, env={"TF_ENABLE_ONEDNN_OPTS": "0"}).split() == [
        "True", "0", "False"]
    assert run_python(code).split()[:2] == ["True", os.environ.get("TF_ENABLE_ONEDNN_OPTS", "None")]
