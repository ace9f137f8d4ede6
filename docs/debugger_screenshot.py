"""Takes docs/debugger_v2.png: TensorBoard's Debugger V2 dashboard showing a dump made by
`oh.DebuggerHandler` (examples/debugger.py), with a headless Chromium.

    python docs/debugger_screenshot.py [--chromium chromium] [--out docs/debugger_v2.png]

Needs `tensorboard` (make test installs it) and Chromium (Debian: `apt-get install
chromium`). Runs the example into a temporary dump directory, starts `tensorboard
--logdir <dump> --host 127.0.0.1` on a free port, waits until the Debugger V2 plugin
serves the run, takes the screenshot and stops TensorBoard.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "__default_debugger_run__"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


def wait_for_run(plugin, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if RUN in get_json(plugin + "/runs"):
                digests = get_json(plugin + "/execution/digests?run=%s&begin=0&end=-1" % RUN)
                if digests.get("num_digests"):
                    return digests["num_digests"]
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("TensorBoard did not serve the debugger run in %d s" % timeout)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "debugger_v2.png"))
    p.add_argument("--size", default="1600,1000")
    args = p.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [ROOT] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    work = tempfile.mkdtemp(prefix="oh-screenshot-")
    dump = os.path.join(work, "dump")
    try:
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "debugger.py"), dump],
                       check=True, env=env, cwd=ROOT)
        port = free_port()
        with open(os.path.join(work, "tensorboard.log"), "w") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", dump, "--host",
                 "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                env=env)
        try:
            n = wait_for_run("http://127.0.0.1:%d/data/plugin/debugger-v2" % port)
            print("TensorBoard serves the run (%d executions)" % n)
            subprocess.run(
                [args.chromium, "--headless", "--no-sandbox", "--disable-gpu",
                 "--hide-scrollbars", "--window-size=" + args.size,
                 "--virtual-time-budget=30000", "--screenshot=" + args.out,
                 "http://127.0.0.1:%d/?darkMode=false#debugger-v2" % port],
                check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
