"""A running video job's lease, held from claim to finish: renewed at each step and every third
of the lease while the steps run, and on a thread of its own while the video is encoded and
written (minutes for a long clip, longer than a lease). Without it, another replica would take
the job over mid-encode and make it a second time.

A renewal the store does not answer (a Redis blip) is tried again at the next beat: the lease is
given up only when the store says another runner holds the job, or when no renewal has landed for
a whole lease (by then the store has let it lapse, and a replica that reaches it may run it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from server.errors import StoreUnavailable
from server.serving.videostore import JobStore, VideoJob

log = logging.getLogger("diffshard")


class Lease:
    def __init__(
        self,
        store: JobStore,
        job: VideoJob,
        worker: str,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.job, self.worker, self.lease_s, self.clock = store, job, worker, lease_s, clock
        self.every_s = lease_s / 3
        self.renewed_at = clock()  # the claim took it

    def renew(self) -> bool:
        """The job's progress written and its lease renewed: True while this runner holds it,
        False once another does. StoreUnavailable once the store has not answered for a lease."""
        try:
            held = self.store.progress(self.job, self.worker)
        except StoreUnavailable:
            if self.clock() - self.renewed_at < self.lease_s:
                log.warning("video job %s: the job store missed a renewal; trying again", self.job.id)
                return True
            raise
        if held:
            self.renewed_at = self.clock()
        return held

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Renewed every `every_s` on a thread while the block runs (the encode and the store's
        write; whether the job is still this runner's, `finish` says, in one step)."""
        done = threading.Event()

        def beat() -> None:
            try:
                while not done.wait(self.every_s) and self.renew():
                    pass
            except StoreUnavailable:
                log.warning("video job %s: its lease lapsed while the store did not answer", self.job.id)

        beating = threading.Thread(target=beat, name="diffshard-video-lease", daemon=True)
        beating.start()
        try:
            yield
        finally:
            done.set()
            beating.join()
