"""`up -n 100`: the time to submit 100 worker jobs, against a stand-in for sbatch that
prints a job id at once (so that the figure is grain's own cost, not the controller's).

    python bench/bench_up.py [N]          # default 100

Then `up -n N --array`: one submission of an array job of N tasks.

grain.py only: upstream Grain's `up` sleeps one second between submissions (so that its
{{HHMMSS}} names differ), about N seconds by construction. The last line is
"up -n N --array X s (S submission(s), T tasks recorded)", after the line
"up -n N X s (Y distinct names)"."""
import os
import re
import subprocess
import sys
import tempfile
import time

from _peers import GRAIN_PY, parse_impl

IMPL, ARGS = parse_impl()
N = int(ARGS[0]) if ARGS else 100

if __name__ == "__main__":
    if IMPL != "grainpy":
        sys.exit("bench_up.py measures grain.py only (upstream sleeps 1 s per submission)")
    with tempfile.TemporaryDirectory() as d:
        fake = os.path.join(d, "sbatch")
        with open(fake, "w") as f:  # a shell script: a Python one would cost more than grain
            f.write(f"#!/bin/sh\necho x >> {d}/count\nwc -l < {d}/count\n")
        os.chmod(fake, 0o755)
        cfg = os.path.join(d, "grain.toml")
        with open(cfg, "w") as f:
            f.write(f'system = "slurm"\naddress = "edge://{d}/edge"\n[worker]\n'
                    f'name = "w{{{{HHMMSS}}}}"\nlog_file = "{d}/w{{{{HHMMSS}}}}.log"\n')
        env = dict(os.environ, PATH=f"{d}:{os.environ['PATH']}", HOME=d)
        for array in ([], ["--array"]):
            open(f"{d}/count", "w").close()
            t = time.perf_counter()
            cp = subprocess.run([sys.executable, GRAIN_PY, "up", "-n", str(N), "-c", cfg,
                                 *array], capture_output=True, text=True, env=env, cwd=d)
            elapsed = time.perf_counter() - t
            if cp.returncode != 0:
                sys.exit(f"up failed: {cp.stderr.strip()}")
            if array:
                with open(f"{d}/count") as f, open(f"{d}/edge.jobs") as book:
                    print(f"up -n {N} --array {elapsed:.2f} s ({len(f.read().split())} "
                          f"submission(s), {len(book.read().splitlines()) - N} tasks recorded)")
            else:
                names = re.findall(r"submitted worker job \S+ \((\S+)\)", cp.stdout)
                print(f"up -n {N} {elapsed:.2f} s ({len(set(names))} distinct names)")
