"""Installation problems give ImportErrors saying what to install or build
(tf_ophandlers/_install_check.py, called first by the package's __init__)."""
import os
import pathlib
import shutil
import subprocess
import sys

import tensorflow as tf

from tf_ophandlers import _install_check

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = ROOT / "tf_ophandlers" / "_install_check.py"


def _python(code, *args, pythonpath=None, isolated=False, cwd=None, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    flags = ["-I", "-S"] if isolated else []
    return subprocess.run([sys.executable, *flags, "-c", code, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or ROOT)


def test_installed_tensorflow_and_extension_load():
    assert _install_check.check_tensorflow() is tf
    from tf_ophandlers import _C  # pylint: disable=import-outside-toplevel
    assert _install_check.load_extension() is _C


def test_missing_tensorflow_says_which_to_install():
    """Without TensorFlow on the path (-S: no site-packages), a clear ImportError naming the
    wheels, not a bare ModuleNotFoundError."""
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('install_check', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "try:\n"
        "    m.check_tensorflow()\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n")
    proc = _python(code, CHECK, isolated=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("ImportError "), out  # not ModuleNotFoundError
    assert "needs TensorFlow 2.21.x, which is not installed" in out
    assert "tensorflow-cpu==2.21.*" in out and "tensorflow==2.21.*" in out


def _package_without_extension(tmp_path):
    """A copy of the package's Python sources, without the compiled extension, whose
    __init__ starts as the real one is meant to (the module's docstring)."""
    pkg = tmp_path / "tf_ophandlers"
    shutil.copytree(ROOT / "tf_ophandlers", pkg,
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    assert not list(pkg.glob("_C*"))
    (pkg / "__init__.py").write_text(
        "from tf_ophandlers._install_check import check_tensorflow, load_extension\n"
        "_tf = check_tensorflow()\n"
        "_C = load_extension()\n")
    return pkg


def test_source_checkout_without_extension_says_to_build_it(tmp_path):
    pkg = _package_without_extension(tmp_path)
    proc = _python("import tf_ophandlers", pythonpath=[tmp_path], cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tf-ophandlers: its C++ extension tf_ophandlers._C "
                           "is not built in %s" % pkg), last
    assert "build the extension first (make build / pip install -e .)" in last
    assert "circular import" not in proc.stderr


def test_extension_that_does_not_load_says_to_rebuild_it(tmp_path):
    pkg = _package_without_extension(tmp_path)
    (pkg / "_C.so").write_bytes(b"not a shared library")  # e.g. a stale, broken build
    proc = _python("import tf_ophandlers", pythonpath=[tmp_path], cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "does not load" in last and "rebuild it (make build / pip install -e .)" in last


def test_other_tensorflow_version_is_refused_by_check_tensorflow():
    code = ("import tensorflow as tf; tf.__version__ = '2.20.1'\n"
            "import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('install_check', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "try:\n"
            "    m.check_tensorflow()\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    proc = _python(code, CHECK)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "supports TensorFlow 2.21.x only" in proc.stdout and "2.20.1" in proc.stdout
