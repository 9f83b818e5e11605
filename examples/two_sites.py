"""One mission over the workers of two clusters (see site_a.toml): each job reports where
it ran. Run it where its config (GRAIN_CONFIG=site_a.toml) names the bridge."""
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.delayed import delayed, run
from grain.resource import Cores


@delayed
async def where(i):
    import trio
    await trio.sleep(0.5)
    return i, socket.gethostname()


async def main():
    ran = [(where @ Cores(1))(i) for i in range(32)]
    hosts = {}
    for i, host in [await r for r in ran]:
        hosts[host] = hosts.get(host, 0) + 1
    for host, n in sorted(hosts.items()):
        print(f"{host}: {n} job(s)")


if __name__ == "__main__":
    run(main)
