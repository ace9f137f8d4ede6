"""Builds tf_ophandlers._C against the TensorFlow 2.21 found at build time.

The extension links libtensorflow_cc.so.2 (TFE_* C API), libtensorflow_framework.so.2
(TF_Status, op registration) and python/lib_pywrap_tensorflow_common.so (EagerTensor
helpers, private symbols: hence the exact version pin), as DESIGN.md records. It never
links libpython. TensorFlow is located without importing it (importing TF takes seconds
and is not needed for a build).

RUNPATH. A wheel (`pip wheel`, `pip install .`, `make wheel`) gets only
`$ORIGIN/../tensorflow` and `$ORIGIN/../tensorflow/python`: installed, the package sits
next to `tensorflow/` in site-packages. An in-place or editable build (`pip install -e .`,
`setup.py build_ext --inplace`, `make build`) also gets the absolute TensorFlow
directories it was built against, since its `.so` files stay in the source tree. Neither
gets the interpreter's own `-Wl,-rpath` (pyenv's LDSHARED carries one): the extension
does not link libpython. In every case `tf_ophandlers/__init__.py` imports TensorFlow
first, so its libraries are already loaded (matched by SONAME) when the extension loads.
"""
import concurrent.futures
import glob
import importlib.util
import os
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

SUPPORTED_TF = "2.21"


def _tensorflow_dir():
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "tf-ophandlers builds against an installed TensorFlow %s.x: install "
            "'tensorflow==%s.*' or 'tensorflow-cpu==%s.*' first "
            "(pip install --no-build-isolation .), or let pip use the build "
            "requirements in pyproject.toml." % (SUPPORTED_TF, SUPPORTED_TF, SUPPORTED_TF))
    return list(spec.submodule_search_locations)[0]


def _copy_public_headers():
    """Copies cc/include/tf_ophandlers/*.h into the package (tf_ophandlers/include), so an
    installed package has the headers handler libraries build against (oh.sysconfig)."""
    import shutil
    src = os.path.join("cc", "include", "tf_ophandlers")
    dst = os.path.join("tf_ophandlers", "include", "tf_ophandlers")
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".h"):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


_copy_public_headers()
tf_dir = _tensorflow_dir()
tf_python = os.path.join(tf_dir, "python")

common = dict(
    include_dirs=["cc", "cc/include", os.path.join(tf_dir, "include"),
                  sysconfig.get_paths()["include"]],
    define_macros=[("_GLIBCXX_USE_CXX11_ABI", "1"), ("EIGEN_MAX_ALIGN_BYTES", "64")],
    extra_compile_args=["--std=c++17", "-O2", "-fvisibility=hidden",
                        "-Wno-sign-compare", "-Wno-unused-function", "-Wno-deprecated-declarations"],
    extra_link_args=[
        "-L" + tf_dir,
        "-l:libtensorflow_framework.so.2",
        "-l:libtensorflow_cc.so.2",
        os.path.join(tf_python, "lib_pywrap_tensorflow_common.so"),
        # Installed next to tensorflow/ in site-packages (build_ext below adds the
        # absolute directories for in-place and editable builds).
        "-Wl,-rpath,$ORIGIN/../tensorflow:$ORIGIN/../tensorflow/python",
    ],
    # Headers too, so that a changed header rebuilds (distutils compares dates).
    depends=sorted(glob.glob("cc/**/*.h", recursive=True)),
    language="c++",
)

# The RUNPATH entry only in-place and editable builds get (see the module docstring).
SOURCE_TREE_RPATH = "-Wl,-rpath," + tf_dir + ":" + tf_python


def without_interpreter_rpaths(command):
    """`command` (a linker command list from sysconfig's LDSHARED) without its
    `-Wl,-rpath,...` / `-Wl,-R...` entries: pyenv's interpreters put their own absolute
    lib directory there, which an extension that never links libpython does not need."""
    return [a for a in command
            if not (a.startswith("-Wl,-rpath") or a.startswith("-Wl,-R"))]


def _compiling_in_parallel(compiler, jobs):
    """`compiler.compile` with up to `jobs` sources compiled at once. distutils compiles an
    extension's sources one after another (its --parallel only builds whole extensions
    at once), and _C has 26 sources, each a compile of TensorFlow's headers: on the
    2-core CI machine this halves the build in every `make` target's install."""
    def compile(sources, output_dir=None, macros=None, include_dirs=None,  # pylint: disable=redefined-builtin
                debug=0, extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(  # pylint: disable=protected-access
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)  # pylint: disable=protected-access
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            # (list(): the first source that fails raises its CompileError here)
            list(pool.map(lambda obj: compiler._compile(  # pylint: disable=protected-access
                obj, build[obj][0], build[obj][1], cc_args, extra_postargs, pp_opts),
                [obj for obj in objects if obj in build]))
        return objects
    return compile


def _build_jobs():
    """OH_BUILD_JOBS, else the CPUs this process may run on."""
    if os.environ.get("OH_BUILD_JOBS"):
        return max(1, int(os.environ["OH_BUILD_JOBS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class build_ext(_build_ext):  # pylint: disable=invalid-name
    """Links with absolute TensorFlow RUNPATHs only for in-place and editable builds, and
    never with the interpreter's. In-place builds link into their own build directory, so
    a later wheel build never reuses an extension linked with absolute paths."""

    def finalize_options(self):
        super().finalize_options()
        # setuptools' run() clears `inplace` while building: remember it now.
        self.inplace_requested = bool(self.inplace)
        if self.inplace and not getattr(self, "editable_mode", False):
            self.build_lib = os.path.join(os.path.dirname(self.build_lib) or "build",
                                          "inplace-" + os.path.basename(self.build_lib))

    def source_tree(self):
        """Whether the extensions stay in the source tree (in-place or editable build)."""
        return bool(getattr(self, "inplace_requested", self.inplace)
                    or getattr(self, "editable_mode", False))

    def link_args(self):
        """The RUNPATH entries this build adds to every extension's link."""
        return [SOURCE_TREE_RPATH] if self.source_tree() else []

    def build_extensions(self):
        for attr in ("linker_so", "linker_so_cxx"):
            if getattr(self.compiler, attr, None):
                setattr(self.compiler, attr, without_interpreter_rpaths(
                    getattr(self.compiler, attr)))
        for ext in self.extensions:
            ext.extra_link_args = [a for a in ext.extra_link_args
                                   if a != SOURCE_TREE_RPATH] + self.link_args()
        jobs = _build_jobs()
        if jobs > 1 and all(hasattr(self.compiler, a) for a in
                            ("_setup_compile", "_get_cc_args", "_compile")):
            self.compiler.compile = _compiling_in_parallel(self.compiler, jobs)
        super().build_extensions()


setup(cmdclass={"build_ext": build_ext}, ext_modules=[
    # The Python extension: the dispatcher device and the handler-tensor payloads.
    Extension("tf_ophandlers._C", sources=[
        # The boundary: module, dispatcher device, runtime state, status, Op, payloads.
        "cc/boundary/module.cc", "cc/boundary/runtime.cc", "cc/boundary/status.cc",
        "cc/boundary/op.cc", "cc/boundary/handler_tensor.cc", "cc/boundary/device.cc",
        "cc/kernels/op_outputs.cc",
        # The native handler ABI (C/C++ handler libraries).
        "cc/native/native_build.cc", "cc/native/native_library.cc",
        "cc/native/native_type.cc", "cc/native/native_execute.cc",
        "cc/native/native_nogil.cc", "cc/native/native_value.cc", "cc/native/native_hooks.cc",
        # The per-op fast path.
        "cc/fast/fast_path.cc", "cc/fast/fast_decision.cc", "cc/fast/fast_forward.cc",
        "cc/fast/fast_hook.cc", "cc/fast/fast_record.cc", "cc/fast/fast_trace.cc",
        "cc/fast/fast_convert.cc",
        # Shipped handlers' C++, registered with the fast path through its hook slot.
        "cc/handlers/register.cc", "cc/handlers/async_execution/fast_async.cc",
        "cc/handlers/lazy/fast_lazy.cc", "cc/handlers/lazy/fast_lazy_plan.cc",
        "cc/handlers/gradient_tape/tape_record.cc"],
        **common),
    # A TensorFlow op library (no Python module): loaded with tf.load_op_library so
    # TensorFlow generates the op wrappers and records them on tapes.
    Extension("tf_ophandlers._copy_ops", sources=[
        "cc/kernels/copy_ops.cc", "cc/handlers/data_format/move_axis.cc",
        "cc/handlers/parallel/parallel_ops.cc"], **common),
    # A handler library (no Python module): oh.native.PassThrough and OpCounter, built
    # only against the public header cc/include/tf_ophandlers/handler.h and loaded with
    # oh.load_handler_library. It links TensorFlow's framework library (TF_Status) only.
    Extension("tf_ophandlers._native_handlers", sources=["cc/native/native_handlers.cc"],
              include_dirs=["cc/include", os.path.join(tf_dir, "include")],
              define_macros=common["define_macros"],
              extra_compile_args=common["extra_compile_args"],
              extra_link_args=["-L" + tf_dir, "-l:libtensorflow_framework.so.2",
                               "-Wl,-rpath,$ORIGIN/../tensorflow"],
              language="c++"),
    # A measurement aid for benchmarks/: a custom device that runs nothing.
    Extension("tf_ophandlers._null_device", sources=["cc/testing/null_device.cc"], **common),
])
