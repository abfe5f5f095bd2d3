"""The soak with videos: two replicas of a tiny Wan model
sharing one real Redis job store, under a mixed load of images and video jobs for `--minutes`
(20), while one replica is restarted (SIGTERM, drained, started again) every `--restart-every-s`
(300) and Redis is restarted once, halfway (SIGTERM: it writes its append-only file and comes
back with every job). Does every video job complete exactly once, or fail with a reason worth a
4xx; does no request get a 5xx it should not; does the replica that stays up hold its memory?

Clients (`--clients`, 3) loop: an image (32×32, 2 steps) or a video job (9 frames of 32×32, 3
steps; every third one with `[[slow-encode]]`, whose 8 s encode outlasts the 5 s lease), sent
to either replica as a Kubernetes Service would: a replica that does not answer (restarting) or
answers 503 with Retry-After (draining, the store restarting) is tried again on the other after
that wait. Each video job is then polled until it ends. 503s with Retry-After are counted and
said; any other 5xx fails the target.

Exactly once: a job's content is stored by the one finish its store accepts (one Lua script);
`diffshard_video_seconds_total` counts, on each replica, only finishes that were kept, so over
every lifetime of both replicas it must equal the completed jobs' seconds. Runs
(`diffshard_video_runs_total`) may exceed jobs: a job a restart cut short goes back to the queue
and runs again, as it should.

Memory: the replica that is never restarted, its RSS after the warm-up (a minute of the mix)
and at the end; meets_target also needs its growth < 10%.

What a CPU run cannot show: real Wan sizes (minutes per job, hundreds of MB of content), which
the issue's tests stand in for (a 56 MiB download, an 8 s encode past a 2 s lease).

    python -m benchmarks.serving.video_soak [--quick] [--minutes 20]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.serving.probes import MIB, process_view
from tests.support.live import LiveServer, free_port, live_server
from tests.support.tiny_pipelines import build_wan_folder
from tests.support.waiting import wait_until

IMAGE = {"size": "32x32", "num_inference_steps": 2}
VIDEO = {"size": "32x32", "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 5.0}
LEASE_S = 5
TARGET_RSS_GROWTH = 0.10
POLL_S = (0.05, 1.0)


@contextmanager
def durable_redis(folder: Path) -> Iterator[dict[str, Any]]:
    """A redis-server with an append-only file, on a port of its own, restartable: `restart()`
    stops it with SIGTERM (it writes the file) and starts it again on the same port."""
    program = shutil.which("redis-server")
    if program is None:
        raise SystemExit("redis-server is not on PATH: `make test-tools` installs Debian's")
    port = free_port()
    args = [
        program,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--appendonly",
        "yes",
        "--save",
        "",
        "--dir",
        str(folder),
    ]
    url = f"redis://127.0.0.1:{port}/0"
    held: dict[str, Any] = {"url": url, "process": None}

    def start() -> None:
        held["process"] = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(url, socket_connect_timeout=1)

        def answering() -> bool:
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.BusyLoadingError):
                return False

        wait_until(answering, 30, "redis-server answering")
        client.close()

    def stop() -> None:
        held["process"].send_signal(signal.SIGTERM)
        held["process"].wait(timeout=60)

    def restart() -> float:
        started = time.monotonic()
        stop()
        start()
        return time.monotonic() - started

    held["restart"] = restart
    start()
    try:
        yield held
    finally:
        stop()


class Replicas:
    """Two servers on one store, as a Kubernetes Service sees them; `restart(1)` drains the
    second (SIGTERM) and starts it again. Every lifetime's log is kept: the runs and the made
    videos are counted from them ("video job ID: running", "video job ID: made")."""

    def __init__(self, stack: ExitStack, flags: tuple[str, ...]) -> None:
        self.flags, self.stack = flags, stack
        self.lifetimes: list[LiveServer] = []
        self.servers: list[LiveServer | None] = [self._start(), self._start()]
        self.lock = threading.Lock()

    def _start(self) -> LiveServer:
        server = self.stack.enter_context(live_server(*self.flags))
        self.lifetimes.append(server)
        return server

    def pick(self, turn: int) -> LiveServer | None:
        with self.lock:
            return self.servers[turn % 2] or self.servers[(turn + 1) % 2]

    def restart(self, index: int) -> float:
        started = time.monotonic()
        with self.lock:
            server, self.servers[index] = self.servers[index], None  # clients go to the other
        assert server is not None
        server.process.terminate()  # drained: a job it runs goes back to the queue, an encode ends
        server.process.wait(timeout=120)
        fresh = self._start()
        with self.lock:
            self.servers[index] = fresh
        return time.monotonic() - started

    def counted(self, what: str) -> Counter:
        """Job ids of the log lines "video job ID: WHAT" over every lifetime of both replicas."""
        found: Counter = Counter()
        for server in self.lifetimes:
            for line in list(server.log):
                if (at := line.find("video job ")) >= 0 and f": {what}" in line:
                    found[line[at + len("video job ") :].split(":")[0]] += 1
        return found


class Load:
    """Clients looping over the mix until `stop`; what each request and job came to."""

    def __init__(self, replicas: Replicas, seed: int) -> None:
        self.replicas, self.random = replicas, random.Random(seed)
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.statuses: Counter = Counter()  # "image 200", "video 503", "image error:ConnectError", ...
        self.retried: Counter = Counter()  # 503s with Retry-After, and connections refused, tried again
        self.jobs: dict[str, dict[str, Any]] = {}  # id → its last record (as a poll saw it)
        self.turn = 0

    def count(self, key: str, counter: Counter | None = None) -> None:
        with self.lock:
            (counter if counter is not None else self.statuses)[key] += 1

    def send(self, kind: str, path: str, body: dict[str, Any]) -> httpx.Response | None:
        """POST to a replica, retried on the other (after Retry-After) while it restarts or the
        store does; None once stopped."""
        while not self.stop.is_set():
            with self.lock:
                self.turn += 1
                turn = self.turn
            server = self.replicas.pick(turn)
            if server is None:
                continue
            try:
                response = httpx.post(f"{server.url}{path}", json=body, timeout=300)
            except httpx.TransportError as err:  # a replica stopping or not up yet
                self.count(f"{kind} {type(err).__name__}", self.retried)
                self.stop.wait(0.2)
                continue
            if response.status_code == 503 and "retry-after" in response.headers:
                self.count(f"{kind} 503", self.retried)
                self.stop.wait(min(float(response.headers["retry-after"]), 2.0))
                continue
            self.count(f"{kind} {response.status_code}")
            return response
        return None

    def follow(self, job_id: str) -> None:
        """Poll the job (on either replica) until it ends."""
        wait = POLL_S[0]
        while True:
            server = self.replicas.pick(self.random.randrange(2))
            try:
                answer = httpx.get(f"{server.url}/v1/videos/{job_id}", timeout=60) if server else None
            except httpx.TransportError:
                answer = None
            if answer is not None and answer.status_code >= 500 and "retry-after" not in answer.headers:
                self.count(f"poll {answer.status_code}")
            if answer is not None and answer.status_code == 200:
                record = answer.json()
                with self.lock:
                    self.jobs[job_id] = record
                if record["status"] in ("completed", "failed"):
                    return
            time.sleep(wait)  # a client's poll interval, as OpenAI's SDK polls
            wait = min(POLL_S[1], wait * 2)

    def client(self, index: int) -> None:
        count = 0
        while not self.stop.is_set():
            count += 1
            if self.random.random() < 0.5:
                self.send("image", "/v1/images/generations", {"prompt": f"a red circle {index}", **IMAGE})
                continue
            marker = "[[slow-encode]] " if count % 3 == 0 else ""
            made = self.send("video", "/v1/videos", {"prompt": f"{marker}a blue square {index}", **VIDEO})
            if made is not None and made.status_code == 200:
                job_id = made.json()["id"]
                with self.lock:
                    self.jobs[job_id] = made.json()
                self.follow(job_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 minutes, a replica restart every minute, to check it runs"
    )
    parser.add_argument("--minutes", type=float, default=20, help="how long (default 20)")
    parser.add_argument(
        "--restart-every-s", type=float, default=300, help="a replica restarts this often (default 300)"
    )
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients (default 3)")
    args = parser.parse_args(argv)
    minutes, every_s = (3.0, 60.0) if args.quick else (args.minutes, args.restart_every_s)
    with tempfile.TemporaryDirectory(prefix="diffshard-video-soak-") as temp, ExitStack() as stack:
        folder = build_wan_folder(Path(temp) / "tiny-wan")
        store = stack.enter_context(durable_redis(Path(temp)))
        flags = (
            "--model",
            str(folder),
            "--job-store",
            store["url"],
            "--video-lease-s",
            str(LEASE_S),
            "--inject-faults",
            "--drain-timeout-s",
            "30",
            "--max-queue",
            "64",
        )
        replicas = Replicas(stack, flags)
        load = Load(replicas, seed=0)
        clients = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in clients:
            thread.start()
        started = time.monotonic()
        warm_up_s = min(60.0, minutes * 60 / 4)
        load.stop.wait(warm_up_s)
        steady = replicas.servers[0]
        assert steady is not None
        start = process_view(steady.process.pid)
        print(json.dumps({"phase": "warm_up", "seconds": warm_up_s, "steady_replica": start}), flush=True)
        end_at = started + minutes * 60
        events: list[tuple[float, str]] = [(started + every_s * k, "replica") for k in range(1, 100)]
        events = [e for e in events if e[0] < end_at] + [(started + minutes * 30, "redis")]
        for at, what in sorted(events):
            load.stop.wait(max(0.0, at - time.monotonic()))
            took = replicas.restart(1) if what == "replica" else store["restart"]()
            print(
                json.dumps(
                    {"phase": "restart", "what": what, "at_s": round(at - started), "took_s": round(took, 1)}
                ),
                flush=True,
            )
        load.stop.wait(max(0.0, end_at - time.monotonic()))
        load.stop.set()  # no new requests; the jobs made are followed to their end
        for thread in clients:
            thread.join(timeout=600)
        end = process_view(steady.process.pid)
        made, runs = replicas.counted("made"), replicas.counted("running")
        final = {job_id: record["status"] for job_id, record in load.jobs.items()}
        failed = {
            job_id: load.jobs[job_id].get("error") for job_id, status in final.items() if status == "failed"
        }

    completed = [job_id for job_id, status in final.items() if status == "completed"]
    unfinished = [job_id for job_id, status in final.items() if status not in ("completed", "failed")]
    made_twice = sorted(job_id for job_id, times in made.items() if times > 1)
    not_made = sorted(job_id for job_id in completed if made[job_id] != 1)
    server_errors = {k: v for k, v in load.statuses.items() if k.split()[-1].startswith("5")}
    growth = (end["rss_bytes"] - start["rss_bytes"]) / start["rss_bytes"]
    summary = {
        "summary": True,
        "minutes": minutes,
        "restarts": {"replica": sum(e[1] == "replica" for e in events), "redis": 1},
        "requests": dict(load.statuses),
        "retried_on_the_other_or_later": dict(load.retried),
        "video_jobs": len(final),
        "completed": len(completed),
        "failed": failed,
        "unfinished": unfinished,
        "made_once": len(completed) - len(not_made),
        "made_twice": made_twice,
        "runs": sum(runs.values()),
        "server_errors_5xx": server_errors,
        "steady_rss_start_mib": round(start["rss_bytes"] / MIB, 1),
        "steady_rss_end_mib": round(end["rss_bytes"] / MIB, 1),
        "steady_rss_growth_ratio": round(growth, 4),
        "steady_threads": {"start": start["threads"], "end": end["threads"]},
        "targets": {
            "rss_growth_below": TARGET_RSS_GROWTH,
            "failed": 0,
            "unfinished": 0,
            "made_twice": 0,
            "server_errors_5xx": 0,
        },
        "meets_target": not failed
        and not unfinished
        and not made_twice
        and not not_made
        and not server_errors
        and growth < TARGET_RSS_GROWTH
        and len(completed) > 0,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
