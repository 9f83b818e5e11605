"""The Bridge's figures: remote throughput through a bridge, direct and relayed, against
plain tcp; the cost of frame integrity; the bridge's memory and CPU with 1,000 idle
workers registered.

    python bench/bench_bridge.py [--rounds 3] [N]

1. bench_remote.py (one worker of 8 cores, N no-op jobs, default 10,000) with the head at
   tcp://127.0.0.1, then at bridge://…?direct… (the worker meets it directly), then with
   ?direct=no (every byte relayed by the bridge), then tcp again with TLS (a certificate
   made by the README's openssl line), alternating within each round; the medians in
   tasks/s.
2. Frame integrity: the microseconds a Seal takes to tag and to check one job's frame
   (a "run" message of ~100 bytes), and so per job (4 frames: head and worker each send
   one and check one).
3. 1,000 workers registered at a bridge with no head yet (each a connection that sent
   SUBD and waits), then 10 s idle: the bridge's RSS and its CPU over those 10 s.
The last line: "tcp X direct Y relayed Z tls T tasks/s; seal S us/job; idle rss R MB cpu
C %"."""
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _peers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import grain  # noqa: E402

ARGS = sys.argv[1:]
ROUNDS = int(ARGS.pop(ARGS.index("--rounds") + 1)) if "--rounds" in ARGS else 3
if "--rounds" in ARGS:
    ARGS.remove("--rounds")
N = ARGS[0] if ARGS else "10000"


def start_bridge():
    port = _peers.free_port()
    proc = subprocess.Popen([sys.executable, grain.__file__, "bridge", "--listen",
                             f"tcp://127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the bridge did not start")


def throughput(url, *flags):
    cp = subprocess.run([sys.executable, os.path.join(HERE, "bench_remote.py"), "--url", url,
                         *flags, N], capture_output=True, text=True, timeout=600)
    return float(cp.stdout.strip().splitlines()[-1].split()[0])


def seal_us():
    """Microseconds to tag one write of one job's frame, and to check it (a write of
    several frames costs one tag)."""
    k1, k2 = os.urandom(32), os.urandom(32)
    writer, reader = grain.Seal(k1, k2), grain.Seal(k2, k1)   # (reader checks writer's)
    payload = grain.dumps_control(("run", 12345, b"d" * 32, b"p" * 40, grain.Cores([3]), None))
    n = 100_000
    t = time.perf_counter()
    tags = [writer.tag([grain.FRAME_HEADER.pack(len(payload)), payload]) for _ in range(n)]
    tag = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for f in tags:
        reader.opened(payload, "bench", 1 << 20)
        reader.opened(f[4:], "bench", 1 << 20)
    return tag, (time.perf_counter() - t) / n * 1e6


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def idle_bridge(workers=1000):
    proc, port = start_bridge()
    conns, alone = [], rss_mb(proc.pid)
    try:
        for i in range(workers):
            s = socket.create_connection(("127.0.0.1", port))
            data = f"SUBD,nohead{'0' * 24},10.0.{i // 250}.{i % 250}:4000".encode()
            s.sendall(len(data).to_bytes(4, "big") + data)
            conns.append(s)
        time.sleep(2)   # (all read and registered)
        with open(f"/proc/{proc.pid}/stat") as f:
            before = sum(int(x) for x in f.read().split(")")[1].split()[11:13])
        time.sleep(10)
        with open(f"/proc/{proc.pid}/stat") as f:
            after = sum(int(x) for x in f.read().split(")")[1].split()[11:13])
        print(f"bridge RSS: {alone:.1f} MB alone", file=sys.stderr)
        return rss_mb(proc.pid), (after - before) / os.sysconf("SC_CLK_TCK") / 10 * 100
    finally:
        for s in conns:
            s.close()
        proc.kill()
        proc.wait()


def main():
    figures = {"tcp": [], "direct": [], "relayed": [], "tls": []}
    proc, port = start_bridge()
    tmp = tempfile.TemporaryDirectory()
    cert, key = os.path.join(tmp.name, "tls.crt"), os.path.join(tmp.name, "tls.key")
    subprocess.run(f"umask 077; openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:"
                   f"prime256v1 -nodes -days 1 -subj /CN=grain -keyout {key} -out {cert}",
                   shell=True, check=True, capture_output=True)
    try:
        for r in range(ROUNDS):
            for name, url, *flags in (
                    ("tcp", "tcp://127.0.0.1:0"),
                    ("direct", f"bridge://bench@127.0.0.1:{port}"),
                    ("relayed", f"bridge://bench@127.0.0.1:{port}?direct=no"),
                    ("tls", "tcp://127.0.0.1:0", "--tls", f"{cert},{key}")):
                figures[name].append(throughput(url, *flags))
                print(f"[round {r + 1}/{ROUNDS}] {name}: {figures[name][-1]:.0f} tasks/s",
                      file=sys.stderr)
    finally:
        proc.kill()
        proc.wait()
        tmp.cleanup()
    tag, check = seal_us()
    print(f"seal: tag {tag:.2f} us, check {check:.2f} us per frame", file=sys.stderr)
    rss, cpu = idle_bridge()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"tcp {med['tcp']:.0f} direct {med['direct']:.0f} relayed {med['relayed']:.0f} "
          f"tls {med['tls']:.0f} tasks/s; seal {2 * (tag + check):.1f} us/job; idle rss {rss:.1f} MB "
          f"cpu {cpu:.2f} %")


if __name__ == "__main__":
    main()
