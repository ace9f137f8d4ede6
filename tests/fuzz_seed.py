"""The seed of the randomized differential tests' rotating draws.

Each fuzzer has two kinds of draw: a fixed one (its default seed, the cases its fuzz
findings were found in and are replayed by; marked slow, run by `make test-slow`), and a
smaller draw in `make test` whose seed changes from day to day, so that the suite covers
new programs on each run at a bounded cost. The run's seed is `OH_FUZZ_SEED` when set,
else today's day number (UTC; days since the start of the year 2000): two runs on one day draw the same
cases, and a seed read from a log replays on any later day. (Small: the fuzzers derive
Keras seeds as seed * 1000 + case, which must stay below 2**32.) The session prints it at its end
(conftest.py's `pytest_terminal_summary`), and a failing draw names it with the command
that replays it.
"""
import datetime
import os

# pytest-xdist workers get the controller's seed (conftest.py), so that a run crossing
# midnight draws one set of cases, the one its summary names.
_seed = None


def run_seed():
    """The seed of this run's rotating draws."""
    global _seed  # pylint: disable=global-statement
    if _seed is None:
        value = os.environ.get("OH_FUZZ_SEED")
        _seed = int(value) if value else (
            datetime.datetime.now(datetime.timezone.utc).date() - datetime.date(2000, 1, 1)).days
    return _seed


def set_run_seed(seed):
    global _seed  # pylint: disable=global-statement
    _seed = int(seed)


def replay(nodeid, seed=None):
    """The command that replays the rotating draw of test `nodeid` (a pytest node id)."""
    return "OH_FUZZ_SEED=%d python -m pytest %s" % (
        run_seed() if seed is None else seed, nodeid)
