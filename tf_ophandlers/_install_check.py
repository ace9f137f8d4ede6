"""Installation checks run first by `import tf_ophandlers`, with messages saying what to do.

The package declares `tensorflow>=2.21,<2.22` (pyproject.toml says why `tensorflow` and
not `tensorflow-cpu`), but a user of `tensorflow-cpu` installs it with `--no-deps`, and a
source checkout can run without any TensorFlow: importing without a usable TensorFlow
fails with an ImportError naming both wheels.

This module imports nothing of the package (only the standard library) so that it can
run before TensorFlow and the extension are known to load. `tf_ophandlers/__init__.py`
calls, before anything else:

    from tf_ophandlers._install_check import check_tensorflow, load_extension
    _tf = check_tensorflow()
    _C = load_extension()   # instead of `from tf_ophandlers import _C`
"""
import importlib
import importlib.machinery
import importlib.util
import os
import sys

SUPPORTED_TENSORFLOW = "2.21"
VERSION = "0.1.0"

_INSTALL = (
    "Install either TensorFlow wheel: pip install 'tensorflow==%(v)s.*' (the package's "
    "declared dependency; 'tensorflow[and-cuda]==%(v)s.*' for NVIDIA GPUs) or "
    "pip install 'tensorflow-cpu==%(v)s.*'" % {"v": SUPPORTED_TENSORFLOW})

_BUILD = ("build the extension first (make build / pip install -e .); in an environment "
          "that already has TensorFlow %s: pip install --no-build-isolation --no-deps -e ."
          % SUPPORTED_TENSORFLOW)


def check_tensorflow():
    """Returns the `tensorflow` module, or raises ImportError saying which TensorFlow to
    install (missing, or another version than the one the extension is built for)."""
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    except ModuleNotFoundError as e:
        if e.name != "tensorflow" and not (e.name or "").startswith("tensorflow."):
            raise  # a dependency of TensorFlow itself: its own message is the right one
        raise ImportError(
            "tf-ophandlers %s needs TensorFlow %s.x, which is not installed. %s."
            % (VERSION, SUPPORTED_TENSORFLOW, _INSTALL), name=e.name) from e
    version = getattr(tf, "__version__", "?")
    if not version.startswith(SUPPORTED_TENSORFLOW + "."):
        raise ImportError(
            "tf-ophandlers %s supports TensorFlow %s.x only (its C++ extension uses private "
            "symbols of that release); found TensorFlow %s. Install 'tensorflow==%s.*' or "
            "'tensorflow-cpu==%s.*'."
            % (VERSION, SUPPORTED_TENSORFLOW, version, SUPPORTED_TENSORFLOW,
               SUPPORTED_TENSORFLOW))
    return tf


def load_extension(package="tf_ophandlers"):
    """Returns the compiled extension `<package>._C`, or raises ImportError saying to
    build it (a source checkout without a build), or to rebuild it (a build that does not
    load against the installed TensorFlow). Call it after `check_tensorflow()`: the
    extension needs TensorFlow's libraries loaded."""
    name = package + "._C"
    if name in sys.modules:
        return sys.modules[name]
    pkg = sys.modules.get(package) or importlib.import_module(package)
    where = list(getattr(pkg, "__path__", []))
    # Only the package's own directory: an extension found elsewhere (another checkout's
    # editable install) was built from other sources.
    spec = importlib.machinery.PathFinder.find_spec(name, where)
    if spec is None:
        raise ImportError(
            "tf-ophandlers: its C++ extension %s is not built in %s (running from a "
            "source checkout?): %s" % (name, os.pathsep.join(where), _BUILD), name=name)
    try:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except ImportError as e:
        sys.modules.pop(name, None)
        raise ImportError(
            "tf-ophandlers: its C++ extension %s does not load (%s). It must be built "
            "against the installed TensorFlow %s: rebuild it (make build / pip install "
            "-e .)." % (spec.origin, e, SUPPORTED_TENSORFLOW), name=name) from e
    setattr(pkg, "_C", module)
    return module
