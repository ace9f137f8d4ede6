"""Builds tests/native/failing_handler.cc once with the oh.sysconfig flags (cached by the
hash of the source and the flags, so reruns skip the compiler)."""
import hashlib
import os
import shutil
import subprocess
import tempfile

import pytest

import tf_ophandlers as oh

HERE = os.path.dirname(os.path.abspath(__file__))


def build_handler_library(source):
    cflags = oh.sysconfig.get_compile_flags()
    lflags = oh.sysconfig.get_link_flags()
    with open(source, "rb") as f:
        text = f.read()
    header = os.path.join(oh.sysconfig.get_include(), "tf_ophandlers", "handler.h")
    with open(header, "rb") as f:
        text += f.read()
    key = hashlib.sha256(text + repr((cflags, lflags)).encode()).hexdigest()[:16]
    out_dir = os.path.join(tempfile.gettempdir(), "tf_ophandlers_test_libs")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "%s_%s.so" % (os.path.basename(source)[:-3], key))
    if not os.path.exists(out):
        compiler = shutil.which("g++") or pytest.skip("no g++ to build a handler library")
        tmp = out + ".%d.tmp" % os.getpid()
        # The one-liner of docs/guide.md: g++ -shared -fPIC $(flags) h.cc -o h.so $(link)
        subprocess.run([compiler, "-shared", "-fPIC", "-O1"] + cflags + [source, "-o", tmp]
                       + lflags, check=True)
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def failing_library():
    return oh.load_handler_library(build_handler_library(os.path.join(HERE, "failing_handler.cc")))
