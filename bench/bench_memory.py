"""Memory per queued job: N (default 100,000) no-op Cores(1) jobs submitted to a head that
has no worker yet, so none can run; the growth of this process's RSS divided by N. Prints
bytes/job on the last line.

    python bench/bench_memory.py [--impl grainpy|upstream|dask] [N] [--stall [--daemon]]

grainpy: GrainExecutor listening on an Edge file (so each job is also serialized for a
remote worker, as in real use), exer.submit(). upstream: its GrainExecutor (pure-Python head
on loopback, no local worker), exer.submit(). Dask: client.submit(resources={"cores": 1})
to an in-process LocalCluster whose worker has no "cores", so the tasks wait in its
scheduler (also in this process).

--stall (grain.py): instead, the mission submits the N jobs in chunks of 1,000, letting
the event loop run between chunks (as a mission that awaits anything does), while a task
that asks to wake every 10 ms notes how late it wakes; the last line is "max stall X ms"
(the event loop's longest pause, the chunks' own submitting included), and "p99 Y ms".
With --daemon, the queue is a head daemon's (in this process, its loop the one watched):
a mission at the other end of a memory stream sends it the N jobs, in writes of 1,000."""
import gc
import os
import tempfile
import time

import _peers
from _peers import noop_sync, parse_impl, rss_bytes

IMPL, ARGS = parse_impl()
STALL = "--stall" in ARGS
if STALL:
    ARGS.remove("--stall")
DAEMON = "--daemon" in ARGS
if DAEMON:
    ARGS.remove("--daemon")
N = int(ARGS[0]) if ARGS else 100_000


async def noop():
    pass


def report(before, after):
    print(f"memory ({IMPL}): {N} queued jobs grew RSS by {(after - before) / 2**20:.1f} MiB")
    print(f"{(after - before) / N:.0f} bytes/job")


async def settle():
    import trio
    for _ in range(3):
        await trio.sleep(0.2)
    gc.collect()


async def fill_queue(submit):
    """Submit one job (so that whatever a first job sets up is there), then measure N more,
    report, and leave without waiting for jobs that can never run."""
    submit()
    await settle()
    before = rss_bytes()
    for _ in range(N):
        submit()
    await settle()
    report(before, rss_bytes())
    os._exit(0)


async def stalls(submit, after_chunk=None):
    """Submit N jobs in chunks while a watchdog measures the event loop's pauses
    (``after_chunk``: awaited after each chunk, instead of a bare checkpoint)."""
    import trio
    lags, done = [], False

    async def watchdog():
        while not done:
            t = time.perf_counter()
            await trio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog)
        await trio.sleep(0.05)
        for i in range(0, N, 1000):
            for _ in range(min(1000, N - i)):
                submit()
            await (after_chunk() if after_chunk else trio.sleep(0))
        await trio.sleep(0.5)  # (what the head does with them after)
        done = True
    lags.sort()
    print(f"stalls: {N} jobs submitted in chunks of 1,000; the event loop's longest pause "
          f"{lags[-1] * 1e3:.1f} ms, p99 {lags[int(len(lags) * 0.99)] * 1e3:.1f} ms")
    print(f"max stall {lags[-1] * 1e3:.1f} ms p99 {lags[int(len(lags) * 0.99)] * 1e3:.1f} ms")
    os._exit(0)


def grainpy():
    import trio
    import grain
    from grain.resource import Cores

    async def daemon_stalls():
        """The head daemon's loop while a mission queues N jobs there (no worker)."""
        daemon = grain.HeadDaemon("tcp://127.0.0.1:0", os.urandom(32))
        async with trio.open_nursery() as nursery:
            grain.start_head(daemon, nursery, daemon._push_held)
            head_side, mission_side = trio.testing.memory_stream_pair()
            nursery.start_soon(daemon.service.handle_connection, head_side, "mission")
            async with grain.open_channel(mission_side, "the daemon") as ch:
                ch.send(("mission", {"name": "bench", "token": "bench"}))
                await ch.receive()  # attached
                ch.send(("fn", b"digest", grain.dumps_job_value(noop, ""), "noop"))
                refs = iter(range(N))
                await stalls(lambda: ch.send(("job", next(refs), Cores(1), b"digest",
                                              grain.NO_ARGS_PAYLOAD)), ch.flush)

    async def main(edge):
        if DAEMON:
            import trio.testing
            await daemon_stalls()
        async with grain.GrainExecutor(listen=f"edge://{edge}") as exer:
            if STALL:
                await stalls(lambda: exer.submit(Cores(1), noop))
            await fill_queue(lambda: exer.submit(Cores(1), noop))

    with tempfile.TemporaryDirectory() as d:
        trio.run(main, os.path.join(d, "edge"))


def upstream():
    import trio
    from grain.config import load_conf
    from grain.head import GrainExecutor
    from grain.resource import Cores

    config = load_conf(_peers.upstream_config(_peers.free_port()), "head")

    async def main():
        async with trio.open_nursery() as nursery:
            async with GrainExecutor(_n=nursery, nolocal=True, config=config) as exer:
                await fill_queue(lambda: exer.submit(Cores(1), noop))

    trio.run(main)


def dask():
    import time
    cluster, client = _peers.dask_cluster(1, 1, processes=False)  # offers "cores", not "gpu"
    futures = [client.submit(noop_sync, 0, resources={"gpu": 1}, pure=False)]
    time.sleep(0.5)
    gc.collect()
    before = rss_bytes()
    futures += [client.submit(noop_sync, i, resources={"gpu": 1}, pure=False)
                for i in range(N)]
    while len(cluster.scheduler.tasks) < N + 1:
        time.sleep(0.1)
    time.sleep(0.5)
    gc.collect()
    report(before, rss_bytes())
    os._exit(0)


if __name__ == "__main__":
    {"grainpy": grainpy, "upstream": upstream, "dask": dask}[IMPL]()
