"""Checks a built tf-ophandlers wheel: python/ABI/platform tags, every Python module of
the source tree's tf_ophandlers/, its extension modules, no absolute path in their
RUNPATH, and TensorFlow among its declared dependencies.

    python scripts/check_wheel.py dist/tf_ophandlers-0.1.0-cp313-cp313-linux_x86_64.whl 3.13

Exits non-zero, printing each problem, if the wheel is wrong. Needs `readelf` (binutils,
present wherever the wheel was compiled). tests/test_packaging.py imports its functions.
"""
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

EXTENSIONS = ("_C", "_copy_ops", "_native_handlers", "_null_device")
REQUIRED_DEPENDENCY = re.compile(r"^tensorflow\s*(\(|[<>=!~]).*2\.21", re.I)


def runpath(path):
    """The RUNPATH (or RPATH) entries of the ELF file `path`, from `readelf -d`."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise RuntimeError("readelf not found (install binutils)")
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True,
                         check=True).stdout
    entries = []
    for line in out.splitlines():
        m = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", line)
        if m:
            entries += [e for e in m.group(1).split(":") if e]
    return entries


def absolute_entries(entries):
    """The entries that name a fixed directory (not relative to the library: $ORIGIN)."""
    return [e for e in entries if not (e.startswith("$ORIGIN") or e.startswith("${ORIGIN}"))]


def source_modules(root):
    """The package's Python files under `root` (a source tree), as wheel member names."""
    out = []
    for d, dirs, files in os.walk(os.path.join(root, "tf_ophandlers")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                for f in files if f.endswith(".py")]
    return sorted(out)


def wheel_problems(wheel, python_version, source=None):
    """A list of what is wrong with `wheel` built for `python_version` ("3.13") from the
    source tree `source` (default: this checkout)."""
    source = source or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems = []
    tag = "cp" + python_version.replace(".", "")
    name = os.path.basename(wheel)
    expected = "-%s-%s-linux_x86_64.whl" % (tag, tag)
    if not name.endswith(expected):
        problems.append("%s: tags are not %s" % (name, expected[1:-4]))
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        names = zf.namelist()
        missing = sorted(set(source_modules(source)) - set(names))
        if missing:
            problems.append("modules of the source tree missing: %s" % missing)
        # The public C headers oh.sysconfig.get_include() points handler libraries at.
        if "tf_ophandlers/include/tf_ophandlers/handler.h" not in names:
            problems.append("public header tf_ophandlers/include/tf_ophandlers/handler.h missing")
        shared = sorted(n for n in names if n.endswith(".so"))
        want = sorted("tf_ophandlers/%s.cpython-%s-x86_64-linux-gnu.so" % (e, tag[2:])
                      for e in EXTENSIONS)
        if shared != want:
            problems.append("extension modules %s, expected %s" % (shared, want))
        for member in shared:
            path = zf.extract(member, tmp)
            bad = absolute_entries(runpath(path))
            if bad:
                problems.append("%s: absolute RUNPATH entries %s" % (member, bad))
        metadata = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = []
        if metadata:
            msg = email.parser.Parser().parsestr(zf.read(metadata[0]).decode())
            requires = msg.get_all("Requires-Dist") or []
        if not any(REQUIRED_DEPENDENCY.match(r) for r in requires):
            problems.append("METADATA does not require tensorflow 2.21: %s" % requires)
    return problems


def main(argv):
    if len(argv) != 3:
        print(__doc__)
        return 2
    problems = wheel_problems(argv[1], argv[2])
    for p in problems:
        print("check_wheel: " + p, file=sys.stderr)
    if not problems:
        print("check_wheel: %s ok (tags, extensions, RUNPATH only $ORIGIN-relative, "
              "all modules, requires tensorflow 2.21)" % os.path.basename(argv[1]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
