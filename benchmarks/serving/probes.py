"""What a live server holds, read from outside: its process's resident memory, threads and open
files (/proc), its activation pool (/v1/stats), and both once it has settled. The soaks and the
idle-memory benchmark read the same figures, so they read them here."""

from __future__ import annotations

import os
from typing import Any

from tests.support.live import LiveServer
from tests.support.waiting import wait_until

MIB = 2**20


def process_view(pid: int) -> dict[str, int]:
    """The server process's resident memory, threads and open files, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "rss_bytes": rss_kib * 1024,
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def pool_view(server: LiveServer) -> dict[str, int]:
    """The pool's bytes over every device: pooled, in use, idle (what the budget bounds; the
    largest device's idle bytes too, since the budget is per device)."""
    pools = server.stats()["pool"].values()
    idle = [p.get("bytes_idle", p["bytes_pooled"] - p["bytes_in_use"]) for p in pools]
    return {
        "pooled": sum(p["bytes_pooled"] for p in pools),
        "in_use": sum(p["bytes_in_use"] for p in pools),
        "idle": sum(idle),
        "idle_max_device": max(idle, default=0),
        "evictions": sum(p["evictions"] for p in pools),
    }


def settled(server: LiveServer) -> dict[str, Any]:
    """The process and pool once nothing is in flight and the fd count has stopped moving
    (connections the clients closed are closed by the server within moments)."""
    server.wait_for(lambda s: s["engine"]["active_jobs"] == 0 and s["engine"]["queue_depth"] == 0)
    last: list[int] = []

    def steady() -> bool:
        last.append(process_view(server.process.pid)["fds"])
        return len(last) >= 3 and last[-1] == last[-2] == last[-3]

    wait_until(steady, 10, "the server's open files settling")
    return process_view(server.process.pid) | {"pool": pool_view(server)}
