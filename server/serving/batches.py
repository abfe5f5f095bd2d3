"""Batches run: `BatchRunner` takes lines from the batch store (`batchstore.py`) while this
replica's loops can take background work, submits each to the service as a request at background
priority (it fills the rows interactive requests leave; its deadline is what is left of its
batch's window), and keeps its result: the response the endpoint would have answered, or the
error it would have answered. Once a batch has no line queued or running, one runner closes it:
its output and error files written, its final status set.

The HTTP layer hands the runner what only it knows, so that serving imports nothing of it:
`translate(url, body)` (the endpoint's own checks, raising as the endpoint would, and the
requests with a function answering them: `respond(resolved, images)` → the response's body) and
`refusal(error, request_id)` (the status and error envelope the endpoint answers for an error).

A line this replica could not run (the loops full, the server draining) goes back to its batch's
queue; a line a crash cut short runs again once its lease lapses (`BatchStore.recover`). Its
result is kept only while this runner still holds it: each line once in the output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from server.errors import (
    DeadlineExceeded,
    InvalidRequest,
    OutOfMemory,
    StepFailed,
    StoreUnavailable,
    Unavailable,
)
from server.requests import GenerationRequest
from server.serving.batchstore import ERRORS, OUTPUT, Batch, BatchStore, Line, LineInput, StoredFile, new_id
from server.serving.videostore import PIECE

log = logging.getLogger("diffshard")

POLL_S = 1.0  # how often an idle runner looks for lines another replica queued, and tidies
TIDY_S = 60.0  # how often expired files are looked for (a write to the store each time)
FINISHERS = 4  # threads encoding lines' images and keeping their results, off the step loops
STORE_THREADS = 8  # the API's calls to the store, on threads of their own (a hung store holds these)
# How a line ends that the line itself caused: an error line. Any other end (the replica
# draining, a helper thread lost) says nothing of it: it goes back to its batch's queue.
LINE_FAULTS = (InvalidRequest, OutOfMemory, DeadlineExceeded, StepFailed)
EXPIRED = {"code": "batch_expired", "message": "the batch's completion window ended before this request ran"}
T = TypeVar("T")

Respond = Callable[[list[GenerationRequest], list[Any]], dict[str, Any]]
Translate = Callable[[str, str], tuple[list[GenerationRequest], Respond]]  # (url, body's JSON text)
Refusal = Callable[[Exception, str], tuple[int, dict[str, Any]]]
Notify = Callable[[str, str], None]


@dataclass
class Running:
    """A claimed line while this runner holds it."""

    line: Line
    job: Any = None  # the service's Job, once submitted
    respond: Respond | None = None
    rows: int = 1
    lost: bool = False  # its lease lost, or its batch cancelled or expired: it ends without a result


def response_line(line: LineInput, status: int, body: dict[str, Any]) -> bytes:
    """One line of the output (status 200) or error file, as OpenAI's batch output shapes it."""
    response = {"status_code": status, "request_id": line.id, "body": body}
    return json.dumps(
        {"id": line.id, "custom_id": line.custom_id, "response": response, "error": None}
    ).encode()


def expired_line(line: LineInput) -> bytes:
    return json.dumps(
        {"id": line.id, "custom_id": line.custom_id, "response": None, "error": EXPIRED}
    ).encode()


class BatchRunner:
    """One thread claiming lines while their rows in flight stay under `rows_in_flight` and
    `takes_work()` says the loops can take work; a few threads ending them; another renewing
    their leases, queuing again lines whose runner died, expiring batches past their window,
    closing finished ones and tidying files, on a timer."""

    def __init__(
        self,
        store: BatchStore,
        service: Any,
        translate: Translate,
        refusal: Refusal,
        *,
        rows_in_flight: int,
        lease_s: float,
        file_expiry_s: int,
        max_bytes: int,
        takes_work: Callable[[], bool],
        notify: Notify | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.service, self.translate, self.refusal = store, service, translate, refusal
        self.rows_in_flight, self.lease_s, self.takes_work, self.clock = (
            rows_in_flight,
            lease_s,
            takes_work,
            clock,
        )
        self.file_expiry_s, self.max_bytes = file_expiry_s, max_bytes
        self.notify = notify  # a webhook event before a batch's final move: (type, batch id)
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._lock = threading.Condition()  # the lines held (and their rows): claim, end and renew threads
        self._running: dict[tuple[str, int], Running] = {}
        self._ends: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._asks = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="diffshard-batch-store")
        # daemonic, as the video runner's: a pool's threads are joined at exit, and a line cut
        # short runs again as after a crash
        self._threads = [
            threading.Thread(target=self._run, name="diffshard-batches", daemon=True),
            threading.Thread(target=self._keep, name="diffshard-batch-keeper", daemon=True),
            *(
                threading.Thread(target=self._end_lines, name="diffshard-batch-end", daemon=True)
                for _ in range(FINISHERS)
            ),
        ]
        for thread in self._threads:
            thread.start()

    async def ask(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` (a store read or write of the API's) on the store's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._asks, partial(call, *args))

    def wake(self) -> None:
        """A batch was added: look for its lines now."""
        self._wake.set()

    def announce(self, event: str, batch_id: str) -> None:
        """A webhook event (`batch.failed`, …) for a move about to be stored."""
        if self.notify is not None:
            self.notify(event, batch_id)

    def stop(self) -> None:
        """Claim no more; the lines running are cancelled and go back to their batch's queue."""
        self._stopped.set()
        self._wake.set()
        with self._lock:
            jobs = [r.job for r in self._running.values() if r.job is not None]
        for job in jobs:
            self.service.cancel(job)
        self._asks.shutdown(wait=False, cancel_futures=True)

    def join(self, timeout_s: float) -> None:
        """Wait (after `stop`) for the lines held to be ended, up to `timeout_s`."""
        with self._lock:
            self._lock.wait_for(lambda: not self._running, timeout_s)
        for _ in range(FINISHERS):
            self._ends.put(None)

    # Claiming.

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._turn()
            except StoreUnavailable:  # each held line's lease lapses: a replica reaching the store runs it
                log.warning("batches: the job store does not answer; trying again in %g s", POLL_S)
                self._stopped.wait(POLL_S)
            except Exception:  # a bug here must not end the runner
                log.exception("batches: the runner's turn failed")
                self._stopped.wait(POLL_S)

    def _turn(self) -> None:
        self._wake.clear()  # a line ended or a batch added from here on ends the wait below
        with self._lock:
            room = sum(r.rows for r in self._running.values()) < self.rows_in_flight
        line = (
            self.store.claim(self.worker, self.clock(), self.lease_s) if room and self.takes_work() else None
        )
        if line is None:
            self._wake.wait(POLL_S)
            return
        if self._stopped.is_set():  # stopped during the claim
            self.store.release(self.worker, line.key)
            return
        with self._lock:
            self._running[line.key] = running = Running(line)
        self._start(running)

    def _start(self, running: Running) -> None:
        """The line translated and submitted; its end handed to the end threads."""
        line = running.line
        left_s = line.expires_at - self.clock()
        if left_s <= 0:
            self._keep_result(running, expired_line(line.input), failed=True)
            return
        try:
            requests, running.respond = self.translate(line.input.url, line.input.body)
            # background rows: only the room interactive work leaves; the deadline is the window's
            job = self.service.submit(
                requests, request_id=line.input.id, owner=line.owner, priority="background", timeout_s=left_s
            )
        except Unavailable as err:  # the line is full, the loops cannot take work: not the line's doing
            self._give_back(running, err)
            self._stopped.wait(POLL_S)  # what this replica cannot run now, another may
            return
        except Exception as err:  # the endpoint's own refusal (its field named), or its 500
            self._keep_result(
                running, response_line(line.input, *self.refusal(err, line.input.id)), failed=True
            )
            return
        with self._lock:
            running.job, running.rows = job, job.rows
        job.future.add_done_callback(lambda _: self._ends.put(line.key))

    # Ending.

    def _end_lines(self) -> None:
        while (key := self._ends.get()) is not None:
            with self._lock:
                running = self._running.get(key)
            if running is None:
                continue
            try:
                self._end(running)
            except StoreUnavailable:  # its lease lapses: a replica reaching the store runs it again
                log.warning(
                    "batch line %s: the job store does not answer; it runs again", running.line.input.id
                )
                self._forget(running)
            except Exception:  # a bug ending this line: it fails, others run
                log.exception("batch line %s", running.line.input.id)
                self._failed(running)

    def _failed(self, running: Running) -> None:
        """An error line for a line a bug ended (the details in the log); if even that cannot be
        kept, its lease lapses and it runs again elsewhere."""
        line = running.line.input
        try:
            status, body = self.refusal(RuntimeError("the line could not be ended"), line.id)
            self._keep_result(running, response_line(line, status, body), failed=True)
        except Exception:
            log.exception("batch line %s: its error could not be kept", line.id)
            self._forget(running)

    def _end(self, running: Running) -> None:
        line, job = running.line, running.job
        try:
            images = job.future.result()
        except LINE_FAULTS as err:
            if running.lost:
                self._give_back(running, err)
            elif isinstance(err, DeadlineExceeded) and self.clock() >= line.expires_at - 1:
                self._keep_result(running, expired_line(line.input), failed=True)
            else:
                self._keep_result(running, response_line(line.input, *self.refusal(err, line.input.id)), True)
            return
        except Exception as err:  # cancelled (lost, or the runner stopping), draining: not the line's doing
            self._give_back(running, err)
            return
        assert running.respond is not None
        self._keep_result(
            running, response_line(line.input, 200, running.respond(job.requests, images)), False
        )

    def _keep_result(self, running: Running, text: bytes, failed: bool) -> None:
        try:
            if not self.store.finish(self.worker, running.line.key, text, failed):
                log.warning(
                    "batch line %s: another runner holds it now; its result is not kept",
                    running.line.input.id,
                )
        finally:
            self._forget(running)
        self._close(running.line.batch)  # its last line: closed now, not at the next round

    def _give_back(self, running: Running, why: Exception) -> None:
        log.info("batch line %s goes back to its batch: %s", running.line.input.id, why)
        try:
            self.store.release(self.worker, running.line.key)
        finally:
            self._forget(running)

    def _forget(self, running: Running) -> None:
        with self._lock:
            self._running.pop(running.line.key, None)
            self._lock.notify_all()
        self._wake.set()  # room for another

    # Keeping: leases, expiry, closing, tidying.

    def _keep(self) -> None:
        every_s, tidied_at = min(POLL_S, self.lease_s / 3), 0.0
        while not self._stopped.wait(every_s):
            try:
                self._renew()
                now = self.clock()
                if again := self.store.recover(now):
                    log.info("batches: %d lines whose runner stopped (a crash?) queued again", again)
                for batch in self.store.unfinished():
                    if batch.stopped is None and now >= batch.expires_at:
                        log.info("batch %s: its completion window ended; its queued lines expire", batch.id)
                        self.store.stop(batch.id, "expire", int(now))
                    self._close(batch.id)
                if now >= tidied_at + TIDY_S:
                    tidied_at = now
                    if gone := self.store.tidy(int(now), self.max_bytes, self.file_expiry_s):
                        log.info("batches: %d expired files or ended batches deleted", gone)
            except StoreUnavailable:
                log.warning("batches: the job store does not answer; trying again in %g s", every_s)
            except Exception:  # a bug here must not end the keeper
                log.exception("batches: the store's housekeeping failed")

    def _renew(self) -> None:
        """Every held line's lease renewed; the lines lost (taken over, or their batch cancelled
        or expired) cancelled at their next step: they end without a result."""
        with self._lock:
            keys = list(self._running)
        if not keys:
            return
        lost = self.store.renew(self.worker, keys, self.clock(), self.lease_s)
        with self._lock:
            stopping = [r for key in lost if (r := self._running.get(key)) is not None]
            for running in stopping:
                running.lost = True
        for running in stopping:
            if running.job is not None:
                self.service.cancel(running.job)

    def _close(self, batch_id: str) -> None:
        """The batch closed if every line of it ended and no other runner closes it: its files
        written (what completed, what failed; the lines an expiry left, as expired), then its
        final status, announced first."""
        batch = self.store.take_close(batch_id, self.worker, self.clock(), self.lease_s)
        if batch is None:
            return
        now = int(self.clock())
        final = {"cancel": "cancelled", "expire": "expired"}.get(batch.stopped or "", "completed")
        expired = batch.total - batch.completed - batch.failed if final == "expired" else 0
        files = []
        if batch.completed:
            output = self._file(batch, OUTPUT, now)
            batch.output_file_id = output.id
            files.append((output, self._pieces(batch.id, failed=False, expired=False)))
        if batch.failed or expired:
            errors = self._file(batch, ERRORS, now)
            batch.error_file_id = errors.id
            files.append((errors, self._pieces(batch.id, failed=True, expired=bool(expired))))
        batch.status, batch.failed = final, batch.failed + expired
        setattr(batch, f"{final}_at", now)
        self.announce(f"batch.{final}", batch.id)
        if self.store.close(batch, self.worker, files):
            log.info("batch %s: %s (%d completed, %d failed)", batch.id, final, batch.completed, batch.failed)

    def _file(self, batch: Batch, purpose: str, now: int) -> StoredFile:
        name = f"{batch.id}_{'output' if purpose == OUTPUT else 'error'}.jsonl"
        keep_s = min(batch.output_expires_s or self.file_expiry_s, self.file_expiry_s)
        return StoredFile(new_id("file-"), batch.owner, name, purpose, 0, now, now + keep_s)

    def _pieces(self, batch_id: str, *, failed: bool, expired: bool) -> Iterator[bytes]:
        """The file's lines in the input's order, in pieces of about PIECE bytes."""
        held: list[bytes] = []
        size = 0
        for result in self.store.results(batch_id):
            if result.text is not None and result.failed == failed:
                text = result.text
            elif result.text is None and expired:
                text = expired_line(result.input)
            else:
                continue
            held.append(text + b"\n")
            size += len(text) + 1
            if size >= PIECE:
                yield b"".join(held)
                held, size = [], 0
        if held:
            yield b"".join(held)


def open_batch_store(url: str, model: str) -> BatchStore:
    """The batch store in the job store `url` names, holding `model`'s batches (others may share
    it). Fails fast (ConfigError) when it cannot be opened or reached."""
    if url.startswith(("redis://", "rediss://")):
        from server.serving.batchredis import RedisBatchStore  # the client only where Redis is used

        return RedisBatchStore(url, model)
    from server.serving.batchsqlite import SqliteBatchStore

    return SqliteBatchStore(url, model)


def confirm_batch(store: BatchStore) -> Callable[[Any], bool | None]:
    """A batch event against the batch now (the webhooks' deliverer asks before it sends):
    True while it has that final status, None while it is unfinished (its move is in flight),
    False once it ended otherwise, or is gone."""

    def confirm(event: Any) -> bool | None:
        batch = store.get_batch(event.subject)
        if batch is None:
            return False
        if not batch.finished:
            return None
        return event.type == f"batch.{batch.status}"

    return confirm


__all__ = ["BatchRunner", "confirm_batch", "expired_line", "open_batch_store", "response_line"]
