"""Chaos: N jobs of 0.05-0.5 s through the head daemon on W worker processes of
C cores, first undisturbed, then while a random worker is killed (kill -9) every 2 s and
replaced, and the head daemon is killed twice (at a third and two thirds of the
undisturbed wall time; the mission starts a new one, the workers come back to it).

    python bench/bench_chaos.py [N] [--workers 4] [--cores 4]

Every run of a job writes a line; prints jobs lost (must be 0), jobs run more than once
(and how many of those had run on a killed worker: all of them should have), and the wall
time of both runs. The last line: "lost X, ran twice Y (Z not on a killed worker)"."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GRAIN_PY = os.path.join(ROOT, "grain.py")

MISSION = textwrap.dedent("""
    import json, os, random, sys, time, trio
    sys.path.insert(0, {root!r})
    from grain.delayed import delayed, run
    from grain.resource import Cores

    @delayed
    async def job(i, seconds):
        with open({runs!r}, "a") as f:
            f.write(f"{{i}} {{os.getpid()}}\\n")
        await trio.sleep(seconds)
        return i

    async def main():
        rng = random.Random(1)
        jobs = [(job @ Cores(1))(i, rng.uniform(0.05, 0.5)) for i in range({n})]
        out = []
        for d in jobs:
            try:
                out.append(await d)
            except Exception as e:
                print(f"job failed: {{type(e).__name__}}: {{e}}", file=sys.stderr)
                out.append(None)
        return out

    t = time.time()
    results = run(main, config_file={config!r})
    print(json.dumps({{"results": results, "wall": time.time() - t}}))
""")


def option(args, name, default):
    if name in args:
        i = args.index(name)
        value = int(args[i + 1])
        del args[i:i + 2]
        return value
    return default


class Swarm:
    """A config for an Edge file in a temporary directory, its workers and missions."""

    def __init__(self, d, n, cores):
        self.d, self.cores = d, cores
        self.config = os.path.join(d, "grain.toml")
        self.log = os.path.join(d, "head.log")
        with open(self.config, "w") as f:
            f.write(f'address = "edge://{d}/edge"\n[head.gnaw]\nlog_file = "{self.log}"\n'
                    'idle_quit = "5s"\n')
        self.runs = os.path.join(d, "runs")
        self.script = os.path.join(d, "mission.py")
        with open(self.script, "w") as f:
            f.write(MISSION.format(root=ROOT, runs=self.runs, n=n, config=self.config))
        self.workers, self.killed = [], set()

    def worker(self):
        p = subprocess.Popen([sys.executable, GRAIN_PY, "worker", "--url",
                              f"edge://{self.d}/edge", "--res",
                              json.dumps({"Cores": {"N": self.cores}}), "--oversubscribe"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.workers.append(p)
        return p

    def daemon_pid(self):
        with open(self.log) as f:
            return int(re.findall(r"head daemon pid (\d+)", f.read())[-1])

    def close(self):
        for p in self.workers:
            if p.poll() is None:
                p.kill()
            p.wait()
        subprocess.run([sys.executable, GRAIN_PY, "stop", "-c", self.config],
                       capture_output=True)


def run_mission(swarm, n_workers, chaos_at=None):
    """Run the mission; with ``chaos_at`` (the undisturbed wall time), kill things."""
    for _ in range(n_workers):
        swarm.worker()
    mission = subprocess.Popen([sys.executable, swarm.script], cwd=swarm.d,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng, start, daemon_kills = random.Random(2), time.time(), 0
    next_kill = start + 2
    while mission.poll() is None:
        time.sleep(0.05)
        if chaos_at is None:
            continue
        now = time.time()
        if now >= next_kill:
            next_kill += 2
            alive = [p for p in swarm.workers if p.poll() is None]
            if alive:
                victim = rng.choice(alive)
                victim.kill()
                swarm.killed.add(victim.pid)
                swarm.worker()  # its replacement
        if daemon_kills < 2 and now - start >= chaos_at * (daemon_kills + 1) / 3:
            try:
                os.kill(swarm.daemon_pid(), signal.SIGKILL)
                daemon_kills += 1
                print(f"  killed the head daemon at {now - start:.1f} s", file=sys.stderr)
            except (OSError, IndexError, ValueError):
                pass
    out, err = mission.communicate()
    if mission.returncode != 0:
        sys.exit(f"the mission failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), err


def main():
    args = sys.argv[1:]
    n_workers = option(args, "--workers", 4)
    cores = option(args, "--cores", 4)
    n = int(args[0]) if args else 2000
    with tempfile.TemporaryDirectory() as d:
        os.mkdir(os.path.join(d, "calm"))
        calm = Swarm(os.path.join(d, "calm"), n, cores)
        try:
            quiet, _ = run_mission(calm, n_workers)
        finally:
            calm.close()
        print(f"undisturbed: {n} jobs on {n_workers} workers of {cores} cores in "
              f"{quiet['wall']:.1f} s")
        os.mkdir(os.path.join(d, "chaos"))
        chaos = Swarm(os.path.join(d, "chaos"), n, cores)
        try:
            out, err = run_mission(chaos, n_workers, chaos_at=quiet["wall"])
        finally:
            chaos.close()
        runs = {}
        with open(chaos.runs) as f:
            for line in f:
                i, pid = map(int, line.split())
                runs.setdefault(i, []).append(pid)
        lost = sum(1 for i in range(n) if out["results"][i] != i)
        twice = [i for i, pids in runs.items() if len(pids) > 1]
        unexplained = [i for i in twice if not set(runs[i][:-1]) & chaos.killed]
        print(f"chaos: {len(chaos.killed)} workers killed, the head daemon twice; "
              f"{out['wall']:.1f} s ({out['wall'] / quiet['wall']:.2f} x undisturbed)")
        print(f"lost {lost}, ran twice {len(twice)} ({len(unexplained)} not on a killed "
              "worker)")


if __name__ == "__main__":
    main()
