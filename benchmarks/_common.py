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


def quartiles(xs):
    """(first quartile, third quartile) of `xs`."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


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
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def _busy_seconds():
    """Busy CPU seconds of the whole machine (incl. VM steal) from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU used by everything except this process between start and stop (in cores)."""

    def __init__(self):
        self.busy, self.wall = _busy_seconds(), time.perf_counter()
        t = os.times()
        self.own = t.user + t.system

    def cores(self):
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        t = os.times()
        own = t.user + t.system - self.own
        return max(0.0, (busy - self.busy - own) / (time.perf_counter() - self.wall))


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
