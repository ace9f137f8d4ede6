"""Small helpers shared by the benchmark scripts (timing, machine info, docs sections)."""
import datetime
import gc
import os
import platform
import re
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without PYTHONPATH / pip install -e
    sys.path.append(REPO)

DEFAULT_MD = os.path.join(REPO, "docs", "benchmarks.md")
MD_TITLE = "# Benchmarks"
MD_INTRO = (
    "Performance of tf-ophandlers, reported as ratios against the TensorFlow counterpart "
    "measured in the same run (same process, same machine, configurations interleaved). "
    "Each section below is written by one script in `benchmarks/` and is replaced "
    "wholesale when that script is rerun; absolute times depend on the machine, the "
    "ratios are the result.")


def time_per_call(fn, n):
    """Seconds per call of `fn()` over `n` back-to-back calls, gc disabled (as timeit)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        clock = time.perf_counter
        loop = range(n)
        start = clock()
        for _ in loop:
            fn()
        elapsed = clock() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed / n


def median(xs):
    return statistics.median(xs)


def machine_info():
    """Dict of the facts a reader needs to interpret absolute times."""
    import tensorflow as tf
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": ncpu,
        "cpu": cpu,
        "os": "%s %s" % (platform.system(), platform.release()),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "load": load_average(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def load_average():
    """1-minute load average as a string ('n/a' where unavailable)."""
    try:
        return "%.2f" % os.getloadavg()[0]
    except (AttributeError, OSError):
        return "n/a"


def write_section(path, name, body):
    """Writes `body` between `<!-- name:begin -->` / `<!-- name:end -->` in `path`.

    Only that section is replaced; the file is created (title + intro) if missing and
    the section appended if absent.
    """
    begin, end = "<!-- %s:begin -->" % name, "<!-- %s:end -->" % name
    section = "%s\n%s\n%s" % (begin, body.strip("\n"), end)
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    else:
        text = "%s\n\n%s\n" % (MD_TITLE, MD_INTRO)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
