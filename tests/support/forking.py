"""`python -m MODULE ARGS` as a process of its own, forked from one that already imported what
`python -m server` imports (torch, diffusers, the app: seconds a start, paid once a session).

`Forked.run` runs one to its end (the CLI's tests); `Forked.spawn` starts one and hands back a
`ForkedProcess`, which a caller signals and waits for as it would a `subprocess.Popen` (live
servers: `tests/support/live.py`; the GPU check's phases with `--fork`). A spawned process's
stdout and stderr are the file descriptors given, passed over the fork server's socket
(SCM_RIGHTS): a pipe reads as it would from `Popen`."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

# the fork server: imports once, then forks a run a request
FORK_SERVER = r"""
import array, gc, json, os, runpy, socket, sys

listener = socket.socket(fileno=int(sys.argv[1]))
import server.__main__  # for what it imports (torch, diffusers, the app), not for itself: -m
import torch  # runs __main__.py afresh in each child, so it is forgotten here

del sys.modules["server.__main__"], sys.modules["server"].__main__

sys.stdout.flush()
sys.stderr.flush()
forkable = not torch.cuda.is_initialized()  # CUDA cannot be used again in a forked child
gc.freeze()  # the children's collections, and their exits, skip what is shared: no copy of each page


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def receive(conn):
    # a request: one JSON line, and with it the descriptors for the run's stdout and stderr
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            break
        data += more
    return json.loads(data), fds


def serve():
    while True:
        conn, _ = listener.accept()
        request, fds = receive(conn)
        if "argv" not in request:
            conn.sendall(json.dumps({"forkable": forkable}).encode() + b"\n")
        elif os.fork() == 0:  # a watcher: forks the run, says its pid, then its exit code
            listener.close()
            pid = os.fork()
            if pid == 0:
                conn.close()
                request["fds"] = fds
                return request
            for fd in fds:  # the run's alone: a pipe's reader sees its end when the run exits
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            status = os.waitpid(pid, 0)[1]
            conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()
        reap()


request = serve()  # only a forked run gets here: it runs as `python -m MODULE ARGS` would
if request.get("session"):
    os.setsid()  # its own process group: killed at a limit, its children go with it
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
if request["fds"]:
    for target, fd in zip((1, 2), request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
else:
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
sys.argv = request["argv"]  # [MODULE, ARGS...]: run_module makes the first its file, as -m does
del request, listener
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)  # uncaught: a traceback, exit 1
"""


class ForkedProcess:
    """A spawned run, as much of `subprocess.Popen` as tests use: `pid`, `send_signal`,
    `terminate`, `kill`, `poll`, `wait` and `returncode`. Its exit code comes from the fork
    server's watcher, over the connection kept open for it."""

    def __init__(self, pid: int, answers: BinaryIO, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self._answers = answers
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: a run that has exited is not signalled
            with contextlib.suppress(ProcessLookupError):  # exited since: its code is on its way
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._answers], [], [], 0)[0]:
            self._read_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._answers], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_code()
        assert self.returncode is not None
        return self.returncode

    def _read_code(self) -> None:
        line = self._answers.readline()
        # a watcher gone without a word (the fork server killed): the run went with its session
        self.returncode = json.loads(line)["code"] if line else -signal.SIGKILL
        self._answers.close()


class Forked:
    """The fork server and its runs. What its import printed starts every `run`'s output, as it
    would a fresh interpreter's; `import_s` is its time, to add where a test times a start.
    Without fork (CUDA already initialised), a plain subprocess."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.names = itertools.count()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(folder / "fork.sock"))
        self.listener.listen(64)
        started = time.monotonic()
        with (folder / "import.out").open("w") as out, (folder / "import.err").open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-c", FORK_SERVER, str(self.listener.fileno())],
                pass_fds=[self.listener.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=(env or os.environ) | {"HF_HUB_OFFLINE": "1"},
            )
        self.listener.close()  # the fork server's now: if it dies, connecting to it fails at once
        try:
            with self._ask({}, timeout_s=120) as answers:  # answered once the imports are done
                answer = answers.readline()
        except ConnectionError:
            answer = b""
        if not answer:
            self.process.wait(timeout=30)
            raise RuntimeError(f"the fork server died importing: {(folder / 'import.err').read_text()}")
        self.forkable: bool = json.loads(answer)["forkable"]
        self.import_s = time.monotonic() - started
        self.preamble = [(folder / f"import.{stream}").read_text() for stream in ("out", "err")]

    def _ask(self, request: dict, timeout_s: float | None, fds: tuple[int, ...] = ()) -> BinaryIO:
        """The fork server's answers to `request` (sent with `fds`), a line each."""
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(timeout_s)
            conn.connect(str(self.folder / "fork.sock"))
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], list(fds))
            return conn.makefile("rb")  # keeps the connection open until it closes

    def run(
        self, module: str, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """As `subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
        text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"} | env, timeout=timeout_s)`."""
        env = os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {})
        command = [sys.executable, "-m", module, *args]
        if not self.forkable:
            return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        name = next(self.names)
        paths = [self.folder / f"{name}.{stream}" for stream in ("out", "err")]
        request = {"argv": [module, *args], "env": env, "cwd": os.getcwd()}
        with self._ask(request | {"stdout": str(paths[0]), "stderr": str(paths[1])}, timeout_s) as answers:
            pid = json.loads(answers.readline())["pid"]
            try:
                code = json.loads(answers.readline())["code"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout_s) from None
        out, err = (before + path.read_text() for before, path in zip(self.preamble, paths, strict=True))
        for path in paths:
            path.unlink()
        return subprocess.CompletedProcess(command, code, out, err)

    def spawn(
        self, module: str, *args: str, env: dict[str, str], stdout: int, stderr: int, session: bool = False
    ) -> ForkedProcess:
        """`python -m module args` started with `env` (whole), writing to the descriptors
        `stdout` and `stderr` (the caller closes its own copies); it runs until it exits. With
        `session`, in a session of its own (`start_new_session`: its pid is its process group)."""
        request = {"argv": [module, *args], "env": env, "cwd": os.getcwd(), "session": session}
        answers = self._ask(request, None, (stdout, stderr))
        line = answers.readline()
        if not line:
            raise RuntimeError(f"the fork server did not start {module}: {self.process.poll()=}")
        return ForkedProcess(json.loads(line)["pid"], answers, [sys.executable, "-m", module, *args])

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
