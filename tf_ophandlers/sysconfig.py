"""`oh.sysconfig`: flags to build a handler library against the installed package (like
`tf.sysconfig`).

    g++ -shared -fPIC $(python -c "import tf_ophandlers as oh; \\
        print(' '.join(oh.sysconfig.get_compile_flags()))") my_handler.cc -o my_handler.so \\
        $(python -c "import tf_ophandlers as oh; print(' '.join(oh.sysconfig.get_link_flags()))")

A handler written in C uses `get_c_compile_flags()` (the same without C++-only flags):

    gcc -std=c11 -shared -fPIC $(python -c "import tf_ophandlers as oh; \\
        print(' '.join(oh.sysconfig.get_c_compile_flags()))") my_handler.c -o my_handler.so \\
        $(python -c "import tf_ophandlers as oh; print(' '.join(oh.sysconfig.get_link_flags()))")

The library includes ``tf_ophandlers/handler.h`` (valid C and C++) and exports
``TFOH_InitHandlerLibrary`` (docs/guide.md, "Writing a handler in C++").

A program with no Python that uses handlers through TensorFlow's C API includes
``tf_ophandlers/c_api.h`` and links with `get_c_api_link_flags()`
(docs/using-handlers-from-c.md):

    gcc -std=c11 $(python -c "import tf_ophandlers as oh; \\
        print(' '.join(oh.sysconfig.get_c_compile_flags()))") my_program.c -o my_program \\
        $(python -c "import tf_ophandlers as oh; print(' '.join(oh.sysconfig.get_c_api_link_flags()))")

Examples:
    >>> import os
    >>> os.path.exists(os.path.join(oh.sysconfig.get_include(), "tf_ophandlers", "handler.h"))
    True
"""
import os

import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_include():
    """The directory holding ``tf_ophandlers/handler.h``: the source tree's ``cc/include``
    in a checkout (editable installs), else the copy installed in the package."""
    for candidate in (os.path.join(os.path.dirname(_HERE), "cc", "include"),
                      os.path.join(_HERE, "include")):
        if os.path.exists(os.path.join(candidate, "tf_ophandlers", "handler.h")):
            return candidate
    raise OSError("tf_ophandlers: the C headers (tf_ophandlers/handler.h) are not installed")


def get_compile_flags():
    """Compiler flags: this package's and TensorFlow's include directories, TensorFlow's
    ABI and language flags."""
    return ["-I" + get_include()] + list(tf.sysconfig.get_compile_flags())


def _cxx_only(flag):
    """A flag a C compiler rejects or warns about: a C++ language standard."""
    for prefix in ("-std=", "--std="):
        if flag.startswith(prefix):
            return "++" in flag[len(prefix):]
    return False


def get_c_compile_flags():
    """`get_compile_flags()` for a handler written in C: without C++-only flags
    (TensorFlow's ``--std=c++17``); pick the C standard yourself (``-std=c11``)."""
    return [f for f in get_compile_flags() if not _cxx_only(f)]


def get_link_flags():
    """Linker flags: TensorFlow's framework library (TF_Status, TF_Buffer), with an rpath
    so the library also loads outside a TensorFlow process. A handler library does not
    link this package: the runtime hands it its functions (TFOH_RuntimeApi)."""
    tf_lib = tf.sysconfig.get_lib()
    return list(tf.sysconfig.get_link_flags()) + ["-Wl,-rpath," + tf_lib]


def get_c_api_library():
    """The path of ``libtf_ophandlers_c.so``, the C API's library (``make c-api`` builds it
    into the package directory). Raises OSError when it is not built."""
    path = os.path.join(_HERE, "libtf_ophandlers_c.so")
    if not os.path.exists(path):
        raise OSError("tf_ophandlers: %s is not built: run `make c-api` in the source tree "
                      "(docs/using-handlers-from-c.md)" % path)
    return path


def get_c_api_link_flags():
    """Linker flags for a program using ``tf_ophandlers/c_api.h``: the C API's library and
    TensorFlow's framework and eager C API libraries, with rpaths so that the program runs
    without LD_LIBRARY_PATH. None of them is libpython."""
    here = os.path.dirname(get_c_api_library())
    tf_lib = tf.sysconfig.get_lib()
    return (["-L" + here, "-ltf_ophandlers_c", "-Wl,-rpath," + here]
            + list(tf.sysconfig.get_link_flags())
            + ["-l:libtensorflow_cc.so.2", "-Wl,-rpath," + tf_lib])
