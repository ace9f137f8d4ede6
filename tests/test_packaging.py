"""Import-time version check, the benchmark scripts' smoke runs, and the packaging (issue
24: wheels without absolute RUNPATHs, declared dependencies, Pythons 3.10-3.13)."""
import importlib.util
import os
import pathlib
import re
import shutil
import sys

import pytest
import tensorflow as tf
from python_process import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_other_tensorflow_version_is_refused_with_a_clear_message():
    code = ("import tensorflow as tf; tf.__version__ = '2.20.1'\n"
            "import tf_ophandlers")
    proc = run_python(code, timeout=240, check=False)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "supports TensorFlow 2.21.x only" in proc.stderr and "2.20.1" in proc.stderr


import benchmark_runs  # noqa: E402
from benchmark_runs import BENCHMARKS, result as benchmark_result  # noqa: E402


@pytest.mark.parametrize("name,options,expected", BENCHMARKS, ids=[b[0] for b in BENCHMARKS])
def test_benchmark_quick_run(name, options, expected):
    # Run in the background from the end of collection (tests/benchmark_runs.py).
    del options  # part of the id's parameters; benchmark_runs passes them
    run = benchmark_result(name)
    assert run.returncode == 0, run.stderr[-2000:]
    text = run.text
    assert "<!-- %s:begin -->" % name in text
    for s in expected:
        assert s in text, s
    # The plot the page shows was written beside it.
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert image in run.files, (image, run.files)
    # Current results only: no issue numbers, named rounds or earlier figures.
    history = benchmark_runs.HISTORY.search(text)
    assert history is None, text[max(0, history.start() - 200):history.end() + 200]


@pytest.mark.slow  # ResNet50 steps in 15 child processes: about four minutes
def test_recompute_resnet_benchmark_measures_each_configuration_in_a_child_process(
        tmp_path):
    # The ResNet50 page's script has no quick run (its smallest run is this one): each
    # configuration of a batch is measured by the script again in a new process
    # (--measure-only), and batch 16, which has a target, adds the sweep of the policy's
    # settings (a process each).
    # (fresh: the script sets TF_CPU_ALLOCATOR_USE_BFC before it imports TensorFlow)
    out = tmp_path / "page.md"
    proc = run_python(ROOT / "benchmarks" / "recompute_resnet.py", timeout=900, check=False,
                      args=["--batches", "16", "--steps", "1", "--out", out], fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "| 16 | oh.GradientTape + oh.Recompute() |" in text
    assert "| batch | join_fraction | join_cap | default |" in text
    sweep = [line for line in text.splitlines()
             if re.match(r"\| 16 \| [0-9.]+ \| [0-9.]+ \| (yes)? \|", line)]
    assert len(sweep) > 1 and sum("| yes |" in line for line in sweep) == 1, sweep
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images and all((tmp_path / image).exists() for image in images), images
    history = benchmark_runs.HISTORY.search(text)
    assert history is None, text[max(0, history.start() - 200):history.end() + 200]


# --- Wheels without absolute RUNPATHs, declared dependencies, Pythons 3.10-3.13.
# `make wheel` / `make smoke` (scripts/) build and install real wheels; these tests check
# the pieces cheaply: setup.py's link flags, the wheel checker, pyproject's declarations.
import tf_ophandlers as oh  # noqa: E402  pylint: disable=wrong-import-position

_spec = importlib.util.spec_from_file_location("check_wheel", ROOT / "scripts" / "check_wheel.py")
check_wheel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_wheel)


def _rpaths(args):
    """The RUNPATH entries that linker arguments `args` add."""
    out = []
    for a in args:
        if a.startswith("-Wl,-rpath,"):
            out += a[len("-Wl,-rpath,"):].split(":")
    return out


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py run with setuptools.setup replaced by a recorder: its build_ext command
    class and extensions, without compiling anything."""
    import runpy  # pylint: disable=import-outside-toplevel
    import setuptools  # pylint: disable=import-outside-toplevel
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return seen


class _Compiler:  # stands in for distutils' UnixCCompiler: only the linker commands
    def __init__(self):
        import sysconfig  # pylint: disable=import-outside-toplevel
        # As pyenv's interpreters have it: their own lib directory as an rpath.
        self.linker_so = (sysconfig.get_config_var("LDSHARED").split()
                          + ["-Wl,-rpath,/opt/python/lib"])
        self.linker_so_cxx = ["g++", "-shared", "-Wl,-rpath,/opt/python/lib"]


def _link(setup_py, monkeypatch, **options):
    """Runs the build_ext of setup.py up to the compiler call with `options`; returns
    (command, the linker commands and each extension's link arguments it would use)."""
    from setuptools import Distribution  # pylint: disable=import-outside-toplevel
    from setuptools.command.build_ext import build_ext as base  # pylint: disable=C0415
    cmd = setup_py["cmdclass"]["build_ext"](Distribution({"ext_modules": setup_py["ext_modules"]}))
    for k, v in options.items():
        setattr(cmd, k, v)
    cmd.ensure_finalized()
    cmd.compiler = _Compiler()
    calls = []
    monkeypatch.setattr(base, "build_extensions", lambda self: calls.append(
        (list(self.compiler.linker_so), list(self.compiler.linker_so_cxx),
         {e.name: list(e.extra_link_args) for e in self.extensions})))
    cmd.build_extensions()
    assert len(calls) == 1
    return cmd, calls[0]


def test_a_wheel_build_links_with_origin_relative_runpaths_only(setup_py, monkeypatch):
    _, (linker, linker_cxx, link_args) = _link(setup_py, monkeypatch)
    assert set(link_args) == {"tf_ophandlers._C", "tf_ophandlers._copy_ops",
                              "tf_ophandlers._native_handlers", "tf_ophandlers._null_device"}
    for name, args in link_args.items():
        # The handler library links only libtensorflow_framework (in tensorflow/).
        want = (["$ORIGIN/../tensorflow"] if name == "tf_ophandlers._native_handlers"
                else ["$ORIGIN/../tensorflow", "$ORIGIN/../tensorflow/python"])
        assert _rpaths(args) == want
    # The interpreter's own rpath is gone (the extension never links libpython).
    assert not _rpaths(linker) and not _rpaths(linker_cxx)
    assert linker_cxx == ["g++", "-shared"]


@pytest.mark.parametrize("mode", ["inplace", "editable_mode"])
def test_in_place_and_editable_builds_also_get_the_absolute_tensorflow_dirs(
        setup_py, monkeypatch, mode):
    cmd, (linker, _, link_args) = _link(setup_py, monkeypatch, **{mode: True})
    tf_dir = os.path.dirname(tf.__file__)
    for name, args in link_args.items():
        origin = (["$ORIGIN/../tensorflow"] if name == "tf_ophandlers._native_handlers"
                  else ["$ORIGIN/../tensorflow", "$ORIGIN/../tensorflow/python"])
        assert _rpaths(args) == origin + [tf_dir, os.path.join(tf_dir, "python")]
    assert not _rpaths(linker)
    if mode == "inplace":
        # Linked into its own directory: a later wheel build cannot reuse this link.
        assert os.path.basename(cmd.build_lib).startswith("inplace-lib.")


def test_the_wheel_checker_finds_absolute_runpaths_wrong_tags_and_missing_tensorflow(
        tmp_path):
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    import zipfile  # pylint: disable=import-outside-toplevel
    so = oh._C.__file__  # pylint: disable=protected-access
    entries = check_wheel.runpath(so)
    if so.startswith(str(ROOT)):  # built in place or editable (make build / make test)
        tf_dir = os.path.dirname(tf.__file__)
        assert entries == ["$ORIGIN/../tensorflow", "$ORIGIN/../tensorflow/python",
                           tf_dir, os.path.join(tf_dir, "python")]
        assert check_wheel.absolute_entries(entries) == entries[2:]
    else:  # installed from a wheel
        assert entries and not check_wheel.absolute_entries(entries)
    # A wheel named for another Python, holding this extension, requiring no TensorFlow.
    wheel = tmp_path / "tf_ophandlers-0.1.0-cp39-cp39-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(so, "tf_ophandlers/" + os.path.basename(so))
        zf.writestr("tf_ophandlers-0.1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: tf-ophandlers\nRequires-Dist: numpy\n"
                    "Requires-Dist: tensorflow-cpu==2.21.*\n")
    problems = check_wheel.wheel_problems(str(wheel), "3.%d" % sys.version_info[1])
    text = "\n".join(problems)
    assert "tags are not cp3%d-cp3%d-linux_x86_64" % ((sys.version_info[1],) * 2) in text
    assert "expected" in text  # two extension modules missing
    assert "does not require tensorflow 2.21" in text
    assert "public header tf_ophandlers/include/tf_ophandlers/handler.h missing" in text
    assert "modules of the source tree missing: ['tf_ophandlers/__init__.py'" in text
    assert ("absolute RUNPATH" in text) == so.startswith(str(ROOT))


def _pyproject():
    try:
        import tomllib  # pylint: disable=import-outside-toplevel
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_declared_dependencies_and_pythons():
    meta = _pyproject()
    project = meta["project"]
    assert "tensorflow>=2.21,<2.22" in project["dependencies"]
    assert not any(d.startswith("tensorflow-cpu") for d in project["dependencies"])
    assert "tensorflow-cpu==2.21.*" in meta["build-system"]["requires"]
    # The Pythons the scripts build wheels for are the ones the metadata names.
    text = (ROOT / "scripts" / "pythons.sh").read_text()
    pythons = re.search(r'^SUPPORTED_PYTHONS="(.*)"$', text, re.M).group(1).split()
    assert pythons == ["3.10", "3.11", "3.12", "3.13"]
    assert ["Programming Language :: Python :: " + v for v in pythons] == [
        c for c in project["classifiers"] if c.startswith("Programming Language :: Python")]
    assert project["requires-python"] == ">=3.10"
    assert "%d.%d" % sys.version_info[:2] in pythons


def test_every_package_directory_goes_into_the_wheel():
    """pyproject's package discovery finds every directory of Python files under
    tf_ophandlers/ (a hand-written list once left out tf_ophandlers.core.functions)."""
    from setuptools import find_packages  # pylint: disable=import-outside-toplevel
    dirs = {p.parent for p in (ROOT / "tf_ophandlers").rglob("*.py")}
    assert all((d / "__init__.py").exists() for d in dirs), "a directory without __init__.py"
    expected = sorted(".".join(d.relative_to(ROOT).parts) for d in dirs)
    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    assert sorted(find_packages(str(ROOT), include=find["include"])) == expected
    assert "tf_ophandlers.core.functions" in expected


def test_bazel_build_and_setup_py_compile_the_same_sources():
    """BUILD and setup.py build the same four libraries; a source file added to one
    and not the other would give a Bazel-built library with missing symbols."""
    setup_text = (ROOT / "setup.py").read_text()
    build_text = (ROOT / "BUILD").read_text()
    setup_sources = {}
    for name, body in re.findall(r'Extension\("tf_ophandlers\.(\w+)", sources=\[([^\]]*)\]',
                                 setup_text):
        setup_sources[name] = sorted(re.findall(r'"(cc/[\w./]+\.cc)"', body))
    build_sources = {}
    for name, body in re.findall(r'name = "tf_ophandlers/(\w+)\.so",\s*srcs = \[([^\]]*)\]',
                                 build_text):
        build_sources[name] = sorted(re.findall(r'"(cc/[\w./]+\.cc)"', body))
    assert set(setup_sources) == {"_C", "_copy_ops", "_native_handlers", "_null_device"}
    assert build_sources == setup_sources
