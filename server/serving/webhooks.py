"""Webhooks: the outbox's events (`serving/outbox.py`) POSTed to the operator's endpoints
(`--webhook`), signed as Standard Webhooks are (`webhook-id`, `webhook-timestamp`,
`webhook-signature`: what OpenAI's SDK checks in `client.webhooks.unwrap`).

`Webhooks` is one daemon thread a process, apart from the step loop: it takes the event due first
under a lease (replicas sharing a Redis outbox deliver each event once; one that dies mid-delivery
lets its lease lapse), asks the app whether the move the event announces is stored (`confirm`:
producers add an event before their move), POSTs it to every endpoint that has not acknowledged
it (a 2xx does), and puts it back with a backoff for the others. Delivery is at least once: a
receiver deduplicates by `webhook-id`, the event's id.

Only the configured URLs are ever called (no request names one), redirects are not followed,
each POST is bounded by a timeout and what is read of its answer by READ_CAP.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from server import __version__
from server.errors import StoreUnavailable
from server.serving.outbox import ENDINGS, KEEP_ENDED_S, Event, Outbox, Pending, event_for
from server.serving.videostore import JobStore

log = logging.getLogger("diffshard")

Confirm = Callable[[Event], "bool | None"]
READ_CAP = 64 * 1024  # bytes of an endpoint's answer read (and dropped) before the connection closes
LONGEST_WAIT_S = 3600.0  # the backoff doubles up to this wait between two tries of an event
NOT_YET_S = 1.0  # the first wait for a move still in flight (its producer is storing it)
POLL_S = 1.0  # how often an idle deliverer looks for due events (another replica's, retries)
PURGE_EVERY_S = 3600.0
SECRET_PREFIX = "whsec_"
SECRET_BYTES = (24, 64)  # Standard Webhooks' secrets: 24 to 64 random bytes
RESULTS = ("acknowledged", "failed")  # a POST: a 2xx, or anything else (an error, a timeout, a status)


def check_secret(secret: str) -> str | None:
    """What is wrong with `secret` (never showing it), or None: `whsec_` and base64 of 24–64 bytes."""
    if not secret.startswith(SECRET_PREFIX):
        return f"write {SECRET_PREFIX} followed by base64 (as OpenAI's and Standard Webhooks' secrets are)"
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        return f"what follows {SECRET_PREFIX} is not base64"
    low, high = SECRET_BYTES
    if not low <= len(key) <= high:
        return f"the secret holds {len(key)} bytes; make one of {low} to {high} random bytes"
    return None


def check_url(url: str) -> str:
    """An endpoint as written, if it is an http(s) URL with a host; ValueError (naming only its
    origin: a path or query may hold a token) if not."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"write an http:// or https:// URL with a host, got one starting {url[:12]!r}")
    try:
        parts.port  # noqa: B018 (raises for a port out of range)
    except ValueError as err:
        raise ValueError(f"{origin(url)}: {err}") from None
    return url


def origin(url: str) -> str:
    """What a log line shows of an endpoint: its scheme, host and port (its path and query may
    hold a token)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """`webhook-signature`: v1, then base64 of HMAC-SHA256 under the secret's bytes of
    `{id}.{timestamp}.{body}` (Standard Webhooks)."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = b"%s.%d.%s" % (event_id.encode(), timestamp, body)
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def confirming(confirms: dict[str, Confirm]) -> Confirm:
    """One confirm from several, each for the event types starting with its key ("video.",
    "batch."); an event no key matches is not yet confirmable (None)."""

    def confirm(event: Event) -> bool | None:
        for prefix, check in confirms.items():
            if event.type.startswith(prefix):
                return check(event)
        return None

    return confirm


def video_confirm(store: JobStore) -> Confirm:
    """A video event against its job now: `video.completed` while it is completed, `video.failed`
    while failed; None while queued or running (its move is in flight, or it runs again); False
    once it ended otherwise, or is gone."""

    def confirm(event: Event) -> bool | None:
        job = store.get(event.subject)
        if job is None:
            return False
        if not job.finished:
            return None
        return event.type == f"video.{job.status}"

    return confirm


@dataclass(frozen=True)
class WebhookFigures:
    """For the metrics: this replica's POSTs by result and events by ending; the outbox's pending
    events and the age of the oldest (shared by replicas on Redis; None while it does not answer)."""

    posts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENDINGS, 0))
    pending: int | None = 0
    lag_s: float | None = 0.0


class Webhooks:
    def __init__(
        self,
        outbox: Outbox,
        urls: Iterable[str],
        secret: str,
        *,
        first_retry_s: float,
        retry_for_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.outbox, self.urls, self.clock = outbox, tuple(urls), clock
        self._secret = secret
        self.first_retry_s, self.retry_for_s, self.timeout_s = first_retry_s, retry_for_s, timeout_s
        # each POST takes at most ~4 timeouts (connect, send, answer, its first READ_CAP bytes)
        self.lease_s = 4 * timeout_s * len(self.urls) + 30
        self.confirms: dict[str, Confirm] = {}  # by event type prefix; the app fills it before `start`
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.posts, self.events = Counter(dict.fromkeys(RESULTS, 0)), Counter(dict.fromkeys(ENDINGS, 0))
        self._lock = threading.Lock()  # the counts, read by scrapes
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="diffshard-webhooks", daemon=True)
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            headers={"user-agent": f"diffshard/{__version__}", "content-type": "application/json"},
        )
        # httpx logs every request's full URL at INFO; an endpoint's path or query may hold a token
        logging.getLogger("httpx").setLevel(logging.WARNING)

    def notify(self, type: str, subject: str) -> None:
        """A producer's move about to be stored (the video runner's, the batch runner's): its event
        in the outbox (StoreUnavailable when the store does not answer), the deliverer woken."""
        self.outbox.add(event_for(type, subject, int(self.clock())))
        self._wake.set()

    def start(self) -> None:
        log.info(
            "webhooks: %s (events retried for %g h)",
            ", ".join(origin(url) for url in self.urls),
            self.retry_for_s / 3600,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def join(self, timeout_s: float) -> None:
        """Wait for the thread (after `stop`): for a POST in flight, up to `timeout_s`; the outbox
        closed once it has ended (an event it held comes due again when its lease lapses)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._client.close()
            self.outbox.close()

    def figures(self) -> WebhookFigures:
        try:
            pending, oldest = self.outbox.backlog()
            lag = 0.0 if oldest is None else max(0.0, self.clock() - oldest)
        except StoreUnavailable:
            pending, lag = None, None
        with self._lock:
            return WebhookFigures(dict(self.posts), dict(self.events), pending, lag)

    def _run(self) -> None:
        purged = 0.0
        while not self._stopped.is_set():
            try:
                if self.clock() - purged > PURGE_EVERY_S:
                    self.outbox.purge(self.clock() - KEEP_ENDED_S)
                    purged = self.clock()
                self._wake.clear()  # an event added from here on ends the wait below
                pending = self.outbox.take(self.worker, self.clock(), self.lease_s)
                if pending is not None:
                    self._deliver(pending)
                    continue
            except StoreUnavailable:
                log.warning("webhooks: the job store does not answer; trying again in %g s", POLL_S)
            except Exception:  # a bug here must not end the deliverer
                log.exception("webhooks: a delivery failed")
            self._wake.wait(POLL_S)

    def _deliver(self, pending: Pending) -> None:
        """One event: confirmed, POSTed where not yet acknowledged, then ended or put back."""
        event, now = pending.event, self.clock()
        try:
            confirmed = confirming(self.confirms)(event)
        except StoreUnavailable:
            confirmed = None
        if confirmed is False:
            self._end(event, "unconfirmed")
            return
        acked = set(pending.acked)
        if confirmed:
            body = event.body()
            for url in self.urls:
                if url not in acked and self._post(url, event, body):
                    acked.add(url)
            if acked >= set(self.urls):
                self._end(event, "delivered")
                return
        if now - event.created_at >= self.retry_for_s:
            log.warning(
                "webhook %s (%s %s) dropped: not delivered within %g s",
                event.id,
                event.type,
                event.subject,
                self.retry_for_s,
            )
            self._end(event, "expired")
            return
        wait = min(NOT_YET_S, self.first_retry_s) if confirmed is None and not pending.tries else 0.0
        wait = wait or min(self.first_retry_s * 2**pending.tries, LONGEST_WAIT_S) * random.uniform(0.75, 1.25)
        due = min(self.clock() + wait, event.created_at + self.retry_for_s)  # a last try at the bound
        self.outbox.later(event.id, self.worker, due, pending.tries + 1, frozenset(acked))

    def _end(self, event: Event, ending: str) -> None:
        if self.outbox.end(event.id, self.worker, ending, self.clock()):
            with self._lock:
                self.events[ending] += 1
            if ending == "delivered":
                log.info("webhook %s (%s %s) delivered", event.id, event.type, event.subject)

    def _post(self, url: str, event: Event, body: bytes) -> bool:
        """One signed POST, signed at the send (receivers refuse a timestamp minutes old);
        True on a 2xx. Its answer is read up to READ_CAP and dropped."""
        timestamp = int(self.clock())
        headers = {
            "webhook-id": event.id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self._secret, event.id, timestamp, body),
        }
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._client.stream("POST", url, content=body, headers=headers) as answer:
                read = 0
                for chunk in answer.iter_raw():  # each read under the timeout; all of them under one
                    read += len(chunk)
                    if read >= READ_CAP or time.monotonic() > deadline:
                        break
                status = answer.status_code
        except httpx.HTTPError as err:
            why = type(err).__name__
        else:
            why = "" if 200 <= status < 300 else f"answered {status}"
        with self._lock:
            self.posts["failed" if why else "acknowledged"] += 1
        if why:
            log.warning("webhook %s to %s: %s; tried again later", event.id, origin(url), why)
        return not why
