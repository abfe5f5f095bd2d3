"""`stream: true` on /v1/images/generations and /v1/images/edits: OpenAI's server-sent events
(an edit's are named `image_edit.partial_image` and `image_edit.completed`).

    event: image_generation.partial_image
    data: {"type": "image_generation.partial_image", "b64_json": ..., "partial_image_index": 0,
           "image_index": 0, "created_at": ..., "size": "64x64", "quality": "auto",
           "background": "opaque", "output_format": "png"}

then one `image_generation.completed` per image (the same fields and `usage`, no partial index).
Every event about an image carries its `seed` (an extension), so any image can be made again.
`quality` is the quality used (`quality_of` the steps run); `background` what every image of
the stream is, partial or finished: "transparent" (RGBA, a model with an alpha channel) or
"opaque" (an RGBA image composited over white first).
A partial image is the model's own prediction of the finished image at evenly spaced steps.
With n > 1, `image_index` (diffshard's extension, like `seed`; the SDK keeps unknown fields)
says which image an event is about. An error after the stream began is an `error` event with OpenAI's
envelope, which the SDK raises.

With `stream_progress: true` (an extension) the stream also says where the request is, each
time that changes:

    event: diffshard.progress
    data: {"type": "diffshard.progress", "status": "queued", "queue_position": 2, "step": 0,
           "steps": 25, "created_at": ...}

`queue_position` is 1 for the next request to start (null once running); `step` of `steps` is
the denoising steps done (the least of the n images).

The step loop hands partial images over without waiting, as uint8 pixels: each stream keeps
only the latest one per image (a slow reader skips to the newest, and holds at most n small
frames), so it never stalls other requests; progress is a flag, read when the stream is ready
to write. A stream with nothing to say for `keepalive_s` sends an SSE comment (`: keep-alive`),
so proxies that cut idle connections (nginx, cloud load balancers: ~60 s) leave it open while it
waits in the line or a long step runs. A client that goes away cancels its request at the next
step.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from server.api.errors import domain_response
from server.api.schemas import Usage
from server.errors import Rejected
from server.media.images import encode_async, to_uint8
from server.serving import Job

KINDS = ("image_generation", "image_edit")
EVENTS = (
    *(f"{kind}.{event}" for kind in KINDS for event in ("partial_image", "completed")),
    "diffshard.progress",
    "error",
)
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
# diffshard counts no tokens; the SDK's completed event has a usage object
USAGE = Usage().model_dump()


class Feed:
    """What the step loop's thread tells one stream, handed to the stream's event loop without
    blocking: the latest partial image of each image, and a flag that the job moved."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.latest: dict[int, tuple[int, np.ndarray]] = {}  # image → (partial index, uint8 pixels)
        self.changed = asyncio.Event()  # a partial image came, or the job moved

    def on_partial(self, image: int, partial: int, pixels: Any) -> None:
        frame = to_uint8(pixels)  # a copy, a quarter of the floats' bytes: the loop reuses its buffers
        self._soon(self._offer, image, partial, frame)

    def on_progress(self) -> None:
        self._soon(self.changed.set)

    def take(self) -> list[tuple[int, int, np.ndarray]]:
        """The partial images not yet sent, by image; and clear the flag."""
        taken = [(image, partial, frame) for image, (partial, frame) in sorted(self.latest.items())]
        self.latest.clear()
        self.changed.clear()
        return taken

    def _offer(self, image: int, partial: int, frame: np.ndarray) -> None:
        self.latest[image] = (partial, frame)  # a newer one replaces one not yet sent
        self.changed.set()

    def _soon(self, call: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed (the server stops): nobody listens
            self._loop.call_soon_threadsafe(call, *args)


def progress(job: Job) -> dict[str, Any]:
    """Where the job is: queued (and where in the line) or running, and its steps done."""
    done = job.progress()
    position = job.queue_position
    return {
        "status": "queued" if position is not None else "running",
        "queue_position": position,
        "step": min(step for step, _ in done),
        "steps": max(steps for _, steps in done),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def stamped(kind: str, data: dict[str, Any]) -> str:
    return _event(kind, {**data, "created_at": int(time.time())})


async def image_events(
    job: Job,
    feed: Feed,
    fields: dict[str, Any],
    compression: int | None,
    request_id: str,
    *,
    with_progress: bool = False,
    keepalive_s: float = 15.0,
    kind: str = "image_generation",
) -> AsyncIterator[str]:
    """The events of `job`: its progress if asked for and its partial images as they come (a
    keep-alive comment when nothing came for `keepalive_s`), then each finished image. `fields`
    are said with every image; its `output_format` and `background` say how each is encoded."""
    output_format = fields["output_format"]
    opaque = fields.get("background", "opaque") == "opaque"  # an RGBA image over white

    async def encoded(pixels: Any) -> str:
        return base64.b64encode(await encode_async(pixels, output_format, compression, opaque)).decode()

    done = asyncio.wrap_future(job.future)
    done.add_done_callback(consumed)  # a stream that ends early leaves its outcome to nobody
    said: dict[str, Any] = {}
    changed = asyncio.ensure_future(feed.changed.wait())
    try:
        while True:
            if with_progress and (now := progress(job)) != said:
                said = now
                yield stamped("diffshard.progress", now)
            finished, _ = await asyncio.wait(
                {changed, done}, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not finished:
                yield KEEPALIVE
                continue
            if changed in finished:  # before the end: partial images handed over are all sent
                for image, index, frame in feed.take():
                    data = {
                        "b64_json": await encoded(frame),
                        "partial_image_index": index,
                        "image_index": image,
                        "seed": job.requests[image].seed,
                    }
                    yield stamped(f"{kind}.partial_image", {**data, **fields})
                changed = asyncio.ensure_future(feed.changed.wait())
            elif done in finished:
                break
    finally:
        changed.cancel()
    try:
        images = done.result()
    except Rejected as err:  # the same envelope a plain request would get
        yield _event("error", json.loads(domain_response(err, request_id).body))
        return
    if with_progress and (now := progress(job)) != said:
        yield stamped("diffshard.progress", now)  # every step done
    for image, pixels in enumerate(images):
        seed = job.requests[image].seed
        data = {"b64_json": await encoded(pixels), "image_index": image, "seed": seed, "usage": USAGE}
        yield stamped(f"{kind}.completed", {**data, **fields})


def consumed(outcome: asyncio.Future) -> None:
    """Retrieve an outcome nobody awaits, so asyncio does not log it as never retrieved."""
    if not outcome.cancelled():
        outcome.exception()
