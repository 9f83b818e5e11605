"""Fault campaign: scenarios drawn from seeds, each a small mission on real processes
with faults landing at random moments, and the promise checked after each from the
records the jobs write themselves.

    python bench/bench_faults.py [--scenarios 500] [--first-seed 1]
    python bench/bench_faults.py --replay SEED [--verbose]
    python bench/bench_faults.py --seeds 3,17,40 [--quick]
    python bench/bench_faults.py --hang N    # the hang scenario (below), N times

A scenario (all drawn from its seed): the mission is its own head or goes through the head
daemon; 1-4 workers of 1-2 cores that reattach; the address an Edge file or tcp (then the
workers dial through a relay of this program's, so that their connection can be cut); a
results store or none; 6-14 jobs of 0-2 s asking 1 or 2 cores, some failing (ValueError,
which reaches the caller), some failing once with a temporary error (retried). Then 1-3
faults: SIGKILL, SIGTERM or SIGSTOP (then SIGCONT) of the mission, a worker or the head
daemon, or a worker's connection cut. Each lands at a random moment or a moment tied to
an event: just after a job starts (its store entry not written yet), just after one ends
(its result in flight), just after a worker starts (its handshake) or a mission is run
again (its workers coming back, their jobs being matched). A killed or stopped mission is
run again at once or after a while; a killed worker is replaced.

After each scenario it checks:
  * the mission ends within a bound (completes; "hung" otherwise); a run that fails with
    one clear error (say its head daemon was killed before it answered) is run again, as
    its user would, up to three times ("failed" when the last run exits non-zero);
  * each job's result reaches its caller, right ("lost" otherwise);
  * a job ran more than once only when a run of it was on a worker that was killed,
    stopped or cut off, or was cancelled after its mission was stopped, or it failed (a
    temporary error is retried; a stored failure is run again by the mission's next run),
    or its mission died while it ran through the head daemon (which cancels a dead
    mission's jobs and cannot hand it a result), or (no store) the mission was run again
    ("ran twice");
  * no process of the scenario is left once its workers were told to stop ("left");
  * a store, if any, opens and holds every finished result ("store").
A failing scenario prints its seed and the command that replays it. The last line:
"N scenarios: L lost, D ran twice without a killed worker, H hung, B left behind, ..."."""
import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GRAIN_PY = os.path.join(ROOT, "grain.py")
MARK = "GRAIN_FAULT_SCENARIO"   # in the environment of every process a scenario starts
MISSION_BOUND_S = 90.0          # a mission run that takes longer is hung

MISSION = textwrap.dedent("""
    import json, os, sys, trio
    sys.path.insert(0, {root!r})
    import grain
    from grain.delayed import delayed, run
    from grain.resource import Cores, ZERO
    grain.REJOIN_WAIT_S = 3.0   # (loopback: workers come back within a second)
    # (which run of the mission: with a store a job's arguments are its identity across
    # runs, so it is not one of them there)
    RECORDS, ATTEMPT = {records!r}, "-" if {store!r} else os.environ["FAULT_ATTEMPT"]

    @delayed
    async def work(i, seconds, kind, records, attempt):
        import os, time, trio
        def note(what):
            fd = os.open(records, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{{what}} {{i}} {{run}} {{os.getpid()}} {{attempt}} {{time.time()}}\\n"
                     .encode())
            os.close(fd)
        run = os.urandom(4).hex()
        note("start")
        try:
            await trio.sleep(seconds)
        except BaseException:
            note("cancel")
            raise
        if kind == "fail":
            note("fail")
            raise ValueError(f"job {{i}} fails")
        if kind == "flaky":
            with open(records) as f:
                if not any(line.startswith(f"flaky {{i}} ") for line in f):
                    note("flaky")
                    raise ConnectionResetError(f"job {{i}} fails once")
        note("end")
        return i * i

    async def main():
        jobs = {jobs!r}
        calls = [(work @ Cores(c))(i, s, k, RECORDS, ATTEMPT) for i, c, s, k in jobs]
        out = []
        for call in calls:
            try:
                out.append(["ok", await call])
            except ValueError as e:
                out.append(["error", str(e)])
        return out

    kw = dict(local=ZERO, address={address!r}, config_file=False) if {own!r} else \\
        dict(config_file={config!r})
    print(json.dumps(run(main, results={store!r}, temporary_err=(ConnectionResetError,),
                         **kw)))
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Relay:
    """A worker's way to a tcp head, through this program, so its connection can be cut."""

    def __init__(self, target_port):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs, self.lock, self.closed = [], threading.Lock(), False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        """Cut every connection through it now (both ends see it closed)."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        return bool(pairs)

    def close(self):
        self.closed = True
        self.listener.close()
        self.cut()


def draw(seed, quick=False):
    """The scenario of ``seed``: a dict, all of it from the seed."""
    rng = random.Random(seed)
    s = {"seed": seed, "own": rng.random() < 0.5, "store": rng.random() < 0.7,
         "tcp": rng.random() < 0.5,
         "workers": [rng.choice((1, 2)) for _ in range(rng.randint(1, 2 if quick else 4))]}
    n = rng.randint(4, 8) if quick else rng.randint(6, 14)
    top = max(s["workers"])
    s["jobs"] = [[i, rng.choice((1, 1, 1, top)), round(rng.choice((0, 0.2, 0.5, 1, 2)) *
                                                      (0.5 if quick else 1), 2),
                  rng.choices(("ok", "fail", "flaky"), (8, 1, 1))[0]] for i in range(n)]
    targets = ["mission", "worker"] + ([] if s["own"] else ["head"]) + \
        (["cut"] if s["tcp"] else [])
    s["faults"] = []
    for _ in range(rng.randint(1, 2 if quick else 3)):
        target = rng.choice(targets)
        action = "cut" if target == "cut" else rng.choice(("kill", "kill", "term", "stop"))
        moment = rng.choice(("at", "start", "end", "worker", "rerun"))
        s["faults"].append({
            "target": target, "action": action, "moment": moment,
            "at": round(rng.uniform(0.1, 4.0), 3),     # seconds (moment "at")
            "nth": rng.randint(1, n),                  # the nth event of its kind
            "delta": round(rng.choice((0.0, rng.uniform(0, 0.15), rng.uniform(0, 1))), 4),
            "which": rng.randrange(8),                 # which worker
            "stop_s": round(rng.uniform(0.2, 3.0), 2),  # SIGSTOP for this long
            "again_s": round(rng.choice((0.0, 0.0, rng.uniform(0.2, 3.0))), 2)})
    return s


class Scenario:
    def __init__(self, spec, verbose=False):
        self.spec, self.verbose = spec, verbose
        self.d = tempfile.mkdtemp(prefix=f"grain-faults-{spec['seed']}-")
        self.mark = f"{os.getpid()}-{spec['seed']}-{time.time_ns()}"
        self.env = dict(os.environ, HOME=os.path.join(self.d, "home"), **{MARK: self.mark})
        os.makedirs(self.env["HOME"])
        self.records = os.path.join(self.d, "records")
        open(self.records, "w").close()
        self.port = free_port() if spec["tcp"] else None
        self.address = f"tcp://127.0.0.1:{self.port}" if spec["tcp"] else \
            f"edge://{self.d}/edge"
        self.config = os.path.join(self.d, "grain.toml")
        self.head_log = os.path.join(self.d, "head.log")
        with open(self.config, "w") as f:
            f.write(f'address = "{self.address}"\n[head.gnaw]\nlog_file = "{self.head_log}"\n'
                    'idle_quit = "3s"\n')
        self.script = os.path.join(self.d, "mission.py")
        with open(self.script, "w") as f:
            f.write(MISSION.format(root=ROOT, records=self.records, jobs=spec["jobs"],
                                   address=self.address, own=spec["own"], config=self.config,
                                   store=os.path.join(self.d, "r.db") if spec["store"] else
                                   None))
        self.workers, self.relays = [], []   # [(process, cores)], one relay per worker
        self.faulted = set()                 # pids of workers killed, stopped or cut off
        self.mission_faults = 0              # the mission (or its head daemon) stopped
        self.head_stopped = False            # the head daemon was told to stop (SIGTERM)
        self.attempt, self.mission, self.events = 0, None, []
        self.attempts = []   # [started (time.time()), ended by a kill or term]
        self.clean_failures = 0
        self.worker_starts, self.rerun_starts = [], []
        self.mission_log = open(os.path.join(self.d, "mission.log"), "w")

    def log(self, text):
        self.events.append(f"{time.monotonic() - self.t0:7.3f} {text}")
        if self.verbose:
            print(f"  {self.events[-1]}", file=sys.stderr)

    def start_worker(self, cores, slot=None):
        url = self.address
        if self.spec["tcp"]:
            relay = Relay(self.port)
            url = f"tcp://127.0.0.1:{relay.port}"
            if slot is None:
                self.relays.append(relay)
            else:
                self.relays[slot].close()
                self.relays[slot] = relay
        name = f"w{len(self.worker_starts)}"
        with open(os.path.join(self.d, f"{name}.log"), "w") as log:
            p = subprocess.Popen([sys.executable, GRAIN_PY, "worker", "--name", name, "--url",
                                  url, "--res", json.dumps({"Cores": {"N": cores}}),
                                  "--reattach", "1m", "--oversubscribe"], stdout=log,
                                 stderr=subprocess.STDOUT, env=self.env, cwd=self.d)
        if slot is None:
            self.workers.append((p, cores))
        else:
            self.workers[slot] = (p, cores)
        self.worker_starts.append(time.monotonic())
        self.log(f"worker {name} pid {p.pid} started")

    def start_mission(self):
        self.attempt += 1
        self.attempts.append([time.time(), False])
        self.rerun_starts.append(time.monotonic())
        env = dict(self.env, FAULT_ATTEMPT=str(self.attempt))
        self.mission = subprocess.Popen([sys.executable, self.script], cwd=self.d, env=env,
                                        stdout=subprocess.PIPE, stderr=self.mission_log,
                                        text=True)
        self.mission_started = time.monotonic()
        self.log(f"mission run {self.attempt} pid {self.mission.pid}")

    def failed_cleanly(self):
        """Did the mission's run end with one clear error (a grain error's one line, raised
        where the user's main awaited a job), as the promise allows?"""
        self.mission_log.flush()
        with open(self.mission_log.name) as f:
            text = f.read().rsplit("Traceback (most recent call last)", 1)
        last = text[-1].strip().splitlines()
        while last and last[-1].startswith("grain: "):  # its notes, which Python prints
            last.pop()                                  # after it: which job it was
        ok = len(text) > 1 and last and last[-1].startswith("grain.") and \
            f'File "{self.script}", line' in text[-1]
        self.log(f"mission run {self.attempt} failed: {last[-1] if last else '?'}"
                 f"{'' if ok else ' (not cleanly)'}")
        return ok

    def wait_listening(self):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.mission.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.02)

    def records_now(self):
        with open(self.records) as f:
            return [line.split() for line in f if line.endswith("\n")]

    def daemon_pid(self):
        try:
            with open(self.head_log) as f:
                pids = [int(w.split()[0]) for w in f.read().split("head daemon pid ")[1:]]
        except (OSError, ValueError):
            return None
        return pids[-1] if pids else None

    # -- faults ---------------------------------------------------------------------
    def due(self, fault):
        """The moment (monotonic) ``fault`` lands, or None while its event has not come."""
        moment, delta = fault["moment"], fault["delta"]
        if moment == "at":
            return self.t0 + fault["at"]
        if moment in ("start", "end"):
            stamps = self.stamps.get(moment, [])
            n = fault["nth"]
            return stamps[n - 1] + delta if len(stamps) >= n else None
        times = self.worker_starts if moment == "worker" else self.rerun_starts
        later = [t for t in times if t > fault.get("armed", self.t0)]
        return later[0] + delta if later else None

    def land(self, fault):
        target, action = fault["target"], fault["action"]
        sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}.get(
            action)
        if target == "mission":
            if self.mission is None or self.mission.poll() is not None:
                return False
            self.mission_faults += 1
            self.attempts[-1][1] = action != "stop"
            os.kill(self.mission.pid, sig)
            self.log(f"mission pid {self.mission.pid}: {action}")
            if action == "stop":
                self.resume_at.append((time.monotonic() + fault["stop_s"], self.mission.pid))
            else:
                self.rerun_at = time.monotonic() + fault["again_s"]
            return True
        if target == "head":
            pid = self.daemon_pid()
            if pid is None:
                return False
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return False
            self.mission_faults += 1
            self.head_stopped |= action == "term"
            self.log(f"head daemon pid {pid}: {action}")
            if action == "stop":
                self.resume_at.append((time.monotonic() + fault["stop_s"], pid))
            return True
        slot = fault["which"] % len(self.workers)
        p, cores = self.workers[slot]
        if p.poll() is not None:
            return False
        self.faulted.add(p.pid)
        if target == "cut":
            self.log(f"worker pid {p.pid}: connection cut")
            return self.relays[slot].cut() or True
        os.kill(p.pid, sig)
        self.log(f"worker pid {p.pid}: {action}")
        if action == "stop":
            self.resume_at.append((time.monotonic() + fault["stop_s"], p.pid))
        else:
            self.replace_at.append((time.monotonic() + 0.5, slot))
        return True

    # -- the run ----------------------------------------------------------------------
    def run(self):
        self.t0 = time.monotonic()
        self.stamps, self.resume_at, self.replace_at, self.rerun_at = {}, [], [], None
        if self.spec["tcp"]:   # a worker finds no head at a tcp address that is not up yet
            self.start_mission()
            self.wait_listening()
        for cores in self.spec["workers"]:
            self.start_worker(cores)
        if not self.spec["tcp"]:   # (an Edge file: they wait for the head to write it)
            self.start_mission()
        pending = list(self.spec["faults"])
        seen = 0
        outcome = None
        while outcome is None:
            time.sleep(0.003)
            now = time.monotonic()
            records = self.records_now()
            for rec in records[seen:]:
                self.stamps.setdefault(rec[0] if rec[0] in ("start", "end") else "other",
                                       []).append(now)
            seen = len(records)
            for fault in list(pending):
                at = self.due(fault)
                if at is not None and now >= at:
                    pending.remove(fault)
                    if not self.land(fault):
                        self.log(f"fault {fault['target']} {fault['action']}: nothing to hit")
            for item in [r for r in self.resume_at if r[0] <= now]:
                self.resume_at.remove(item)
                try:
                    os.kill(item[1], signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.log(f"pid {item[1]}: continued")
            for item in [r for r in self.replace_at if r[0] <= now]:
                self.replace_at.remove(item)
                self.start_worker(self.workers[item[1]][1], slot=item[1])
            for slot, (p, cores) in enumerate(self.workers):
                # One that left on its own (its head said goodbye, or went during its
                # first handshake) is replaced, as a swarm's would be: a mission must not
                # wait for ever for want of workers.
                if p.poll() is not None and all(r[1] != slot for r in self.replace_at):
                    self.log(f"worker pid {p.pid} left (exit {p.returncode})")
                    if self.head_stopped:   # a stopped daemon takes its workers along
                        self.faulted.add(p.pid)
                    self.replace_at.append((now + 0.5, slot))
            if self.mission.poll() is not None:
                if self.rerun_at is not None:
                    if now >= self.rerun_at:
                        self.rerun_at = None
                        self.start_mission()
                    continue
                if self.mission.returncode != 0 and self.clean_failures < 3 and \
                        self.failed_cleanly():
                    self.clean_failures += 1   # one clear error: the user runs it again
                    self.start_mission()
                    continue
                outcome = "done"
            elif now - self.mission_started > MISSION_BOUND_S:
                outcome = "hung"
                self.mission.kill()
                self.mission.wait()
        out = self.mission.stdout.read()
        self.log(f"mission run {self.attempt} ended: {outcome}, exit {self.mission.returncode}")
        return outcome, self.mission.returncode, out

    # -- the checks --------------------------------------------------------------------
    def check(self, outcome, code, out):
        problems = []
        if outcome == "hung":
            problems.append(("hung", f"mission run {self.attempt} did not end in "
                                     f"{MISSION_BOUND_S:g} s"))
        elif code != 0:
            with open(self.mission_log.name) as f:
                tail = f.read().strip().splitlines()[-3:]
            problems.append(("failed", f"mission run {self.attempt} exited {code}: "
                                       f"{' | '.join(tail)}"))
        else:
            try:
                results = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                results = None
            for i, _, _, kind in self.spec["jobs"]:
                want = ["error", f"job {i} fails"] if kind == "fail" else ["ok", i * i]
                got = results[i] if results and i < len(results) else None
                if got != want:
                    problems.append(("lost", f"job {i}: {got!r}, not {want!r}"))
        records = self.records_now()
        problems += self.check_runs(records)
        problems += self.check_store(records, outcome == "done" and code == 0)
        problems += self.stop_all()
        return problems

    def check_runs(self, records):
        problems = []
        runs = {}   # job identity -> [(run id, worker pid)]
        ended_how = {}
        for what, i, run, pid, attempt, t in (r[:6] for r in records if len(r) >= 6):
            ident = i if self.spec["store"] else (attempt, i)
            if what == "start":
                runs.setdefault(ident, []).append((run, int(pid), float(t)))
            else:
                ended_how.setdefault(run, what)
        # Through the head daemon, a mission that dies has its running jobs cancelled and
        # loses the results on their way to it (README): its next run runs those again.
        ends = [a[0] for a in self.attempts[1:]] + [float("inf")]
        died = [(a[0], end) for a, end in zip(self.attempts, ends) if a[1]]
        for ident, started in runs.items():
            if len(started) <= 1:
                continue
            # every run but the last must have a reason to be run again
            for run, pid, t in started[:-1]:
                how = ended_how.get(run)
                # (a failure is stored, and run again by the mission's next run: its
                # rerun_failed is on by default)
                if pid in self.faulted or how == "flaky" or (
                        how == "cancel" and self.mission_faults) or (
                        how == "fail" and self.attempt > 1) or (
                        not self.spec["own"] and any(a <= t < b for a, b in died)):
                    continue
                problems.append(("ran twice", f"job {ident}: run {run} on pid {pid} "
                                              f"({how or 'no end recorded'}) ran again"))
        return problems

    def check_store(self, records, completed):
        if not self.spec["store"] or not completed:
            return []
        path = os.path.join(self.d, "r.db")
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                done = db.execute("SELECT COUNT(DISTINCT key) FROM results_log WHERE state "
                                  "= 'done'").fetchone()[0]
        except sqlite3.Error as e:
            return [("store", f"{path} does not open: {e}")]
        want = sum(kind != "fail" for *_, kind in self.spec["jobs"])
        return [] if done >= want else [("store", f"{done} done entries, {want} jobs done")]

    def stop_all(self):
        """Stop the scenario's processes as a user would (SIGTERM to the workers, the
        daemon quits when idle); what still lives after that is left behind. A process still
        stopped (the scenario ended before its SIGCONT was due) is let go on first: a user
        who stopped it would, and a stopped process acts on no signal but SIGKILL."""
        for _, pid in self.resume_at:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.resume_at = []
        for p, _ in self.workers:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    os.kill(p.pid, sig)
        for r in self.relays:
            r.close()
        pid = self.daemon_pid()
        if pid:
            subprocess.run([sys.executable, GRAIN_PY, "stop", "-c", self.config],
                           capture_output=True, env=self.env, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.ours():
            time.sleep(0.05)
        left = self.ours()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p, _ in self.workers:
            p.wait()
        self.mission.wait()
        self.mission_log.close()
        return [("left", f"{len(left)} process(es) left: {self.describe(left)}")] if left \
            else []

    def ours(self):
        mark = f"{MARK}={self.mark}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if f.read().rpartition(b")")[2].split()[0] == b"Z":
                        continue
            except OSError:
                continue
            pids.append(int(entry))
        return pids

    @staticmethod
    def describe(pids):
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f"{pid} " + " ".join(a.decode(errors="replace") for a in
                                                    f.read().split(b"\0")[1:4]))
            except OSError:
                pass
        return "; ".join(out)


def summary_of(spec):
    return (f"{'own head' if spec['own'] else 'head daemon'}, "
            f"{'tcp' if spec['tcp'] else 'edge'}, {'store' if spec['store'] else 'no store'}, "
            f"{len(spec['workers'])} worker(s), {len(spec['jobs'])} jobs; faults: " +
            ", ".join(f"{f['target']} {f['action']} at {f['moment']}" for f in spec["faults"]))


def run_seed(seed, quick=False, verbose=False, keep=False):
    spec = draw(seed, quick)
    if verbose:
        print(f"seed {seed}: {summary_of(spec)}", file=sys.stderr)
    sc = Scenario(spec, verbose)
    try:
        problems = sc.check(*sc.run())
    finally:
        for pid in sc.ours():   # (whatever happened: nothing of it outlives it)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if problems and not keep:
        print(f"  (its files: {sc.d})", file=sys.stderr)
    elif not keep:
        shutil.rmtree(sc.d, ignore_errors=True)
    return spec, problems, sc


HANG_MISSION = textwrap.dedent("""
    import json, os, sys, trio
    sys.path.insert(0, {root!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores, ZERO

    @delayed
    async def work(i):
        import os, trio
        fd = os.open({records!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"start {{i}} {{os.getpid()}}\\n".encode())
        os.close(fd)
        await trio.sleep(5)
        return i * i

    async def main():
        return await each((work @ Cores(1))(i) for i in range(4))

    print(json.dumps(run(main, local=ZERO, address={address!r}, results={store!r},
                         config_file=False)))
""")


def hang_scenario(n):
    """The hang scenario, ``n`` times: two workers that reattach ("2m") serve a mission
    that is its own head (Edge, a results store, four Cores(1) jobs of 5 s); the mission
    is killed (SIGKILL) the moment all four run, and run again 1.5 s later, when it must
    take its workers' running jobs back and complete with each job run once. Returns the
    runs that did not."""
    bad = []
    for k in range(1, n + 1):
        d = tempfile.mkdtemp(prefix="grain-hang-")
        env = dict(os.environ, HOME=os.path.join(d, "home"), **{MARK: f"hang-{d}"})
        records, address = os.path.join(d, "records"), f"edge://{d}/edge"
        script = os.path.join(d, "mission.py")
        with open(script, "w") as f:
            f.write(HANG_MISSION.format(root=ROOT, records=records, address=address,
                                        store=os.path.join(d, "own.db")))
        workers = [subprocess.Popen([sys.executable, GRAIN_PY, "worker", "--name", f"w{i}",
                                     "--url", address, "--res", '{"Cores": {"N": 2}}',
                                     "--reattach", "2m"], env=env, cwd=d,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i in (1, 2)]
        first = subprocess.Popen([sys.executable, script], env=env, cwd=d,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(records) and open(records).read().count("start") == 4:
                break
            time.sleep(0.001)
        first.kill()
        first.wait()
        time.sleep(1.5)
        t = time.monotonic()
        try:
            again = subprocess.run([sys.executable, script], env=env, cwd=d, timeout=60,
                                   capture_output=True, text=True)
            ok = again.returncode == 0 and json.loads(again.stdout) == [0, 1, 4, 9]
            why = "" if ok else f"exit {again.returncode}: {again.stderr[-300:]}"
        except subprocess.TimeoutExpired:
            ok, why = False, "hung (60 s)"
        starts = sorted(line.split()[1] for line in open(records))
        if starts != ["0", "1", "2", "3"]:
            ok, why = False, f"{why} runs: {starts}"
        for p in workers:
            p.kill()
            p.wait()
        print(f"  {k}: {'completed, each job run once' if ok else 'FAILED: ' + why} "
              f"({time.monotonic() - t:.1f} s)", flush=True)
        if ok:
            shutil.rmtree(d, ignore_errors=True)
        else:
            bad.append((k, why, d))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hang", type=int, metavar="N", help="the hang scenario (see hang_scenario), N times")
    ap.add_argument("--scenarios", type=int, default=500)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--seeds", help="comma-separated seeds (instead of --scenarios)")
    ap.add_argument("--replay", type=int, metavar="SEED", help="one seed, its events shown")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter jobs and faults")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.hang:
        bad = hang_scenario(args.hang)
        print(f"hang scenario: {args.hang - len(bad)} of {args.hang} runs completed with "
              f"every job run once ({time.strftime('%Y-%m-%d')})")
        return 1 if bad else 0
    if args.replay is not None:
        seeds, args.verbose = [args.replay], True
    elif args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        seeds = range(args.first_seed, args.first_seed + args.scenarios)
    counts = {k: 0 for k in ("lost", "ran twice", "hung", "left", "failed", "store")}
    bad, t0 = 0, time.time()
    for n, seed in enumerate(seeds, 1):
        spec, problems, sc = run_seed(seed, args.quick, args.verbose)
        kinds = sorted({k for k, _ in problems})
        for k, _ in problems:
            counts[k] += 1
        if problems:
            bad += 1
            quick = " --quick" if args.quick else ""
            print(f"seed {seed} FAILED ({', '.join(kinds)}): {summary_of(spec)}\n" +
                  "".join(f"    {k}: {text}\n" for k, text in problems) +
                  "    events:\n" + "".join(f"      {e}\n" for e in sc.events) +
                  f"    replay: python bench/bench_faults.py --replay {seed}{quick}",
                  flush=True)
        elif args.verbose or n % 25 == 0:
            print(f"  {n} scenarios, {bad} failing, {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"{len(seeds)} scenarios: {counts['lost']} lost, {counts['ran twice']} ran twice "
          f"without a killed worker, {counts['hung']} hung, {counts['left']} left behind, "
          f"{counts['failed']} failed, {counts['store']} store faults "
          f"({time.time() - t0:.0f} s, {time.strftime('%Y-%m-%d')})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
