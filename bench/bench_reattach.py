"""Re-registration: W workers on a head daemon; the daemon is killed (kill -9)
and a new one started; time from the new daemon's start until `ls` shows all W workers
back.

    python bench/bench_reattach.py [--workers 16]

The last line: "reattach X s" (the median of 3 kills)."""
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GRAIN_PY = os.path.join(os.path.dirname(HERE), "grain.py")


def main():
    args = sys.argv[1:]
    n = int(args[args.index("--workers") + 1]) if "--workers" in args else 16
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "grain.toml")
        with open(config, "w") as f:
            f.write(f'address = "edge://{d}/edge"\n')

        def cli(*argv):
            return subprocess.run([sys.executable, GRAIN_PY, *argv, "-c", config],
                                  capture_output=True, text=True).stdout

        def joined():
            m = re.search(r"(\d+) worker\(s\)", cli("ls"))
            return int(m.group(1)) if m else 0

        def head():
            return subprocess.Popen([sys.executable, GRAIN_PY, "head", "-c", config,
                                     "--idle-quit", "10m"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)

        daemon = head()
        workers = [subprocess.Popen([sys.executable, GRAIN_PY, "worker", "--url",
                                     f"edge://{d}/edge", "--res", '{"Cores": {"N": 1}}',
                                     "--name", f"w{i}"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL) for i in range(n)]
        times = []
        try:
            while joined() < n:
                time.sleep(0.1)
            for _ in range(3):
                daemon.send_signal(signal.SIGKILL)
                daemon.wait()
                t0 = time.perf_counter()
                daemon = head()
                while joined() < n:
                    time.sleep(0.02)
                times.append(time.perf_counter() - t0)
                print(f"  all {n} back in {times[-1]:.2f} s", file=sys.stderr)
        finally:
            daemon.kill()
            for w in workers:
                w.kill()
                w.wait()
            daemon.wait()
        print(f"{n} workers back with a new head daemon (kill -9 of the old one)")
        print(f"reattach {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
