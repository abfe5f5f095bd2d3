"""`stream: true` on /v1/images/generations: OpenAI's server-sent events.

    event: image_generation.partial_image
    data: {"type": "image_generation.partial_image", "b64_json": ..., "partial_image_index": 0,
           "image_index": 0, "created_at": ..., "size": "64x64", "quality": "auto",
           "background": "opaque", "output_format": "png"}

then one `image_generation.completed` per image (the same fields, `usage` and its `seed`, no
partial index).
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

The step loop hands partial images over without waiting: each stream buffers at most one
round of them (one per image) plus `PARTIAL_BUFFER` and drops the newest beyond that, so a slow
reader never stalls other requests; progress is a flag, read when the stream is ready to write.
A client that goes away cancels its request at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from server.api.errors import domain_response
from server.errors import Rejected
from server.pipeline.images import encode_async
from server.serving import Job

EVENTS = ("image_generation.partial_image", "image_generation.completed", "diffshard.progress", "error")
PARTIAL_BUFFER = 8
# diffshard counts no tokens; the SDK's completed event has a usage object
USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "input_tokens_details": {}}

Partial = tuple[int, int, Any]  # image index, partial index, [H, W, 3] image


class Feed:
    """What the step loop's thread tells one stream, handed to the stream's event loop without
    blocking: partial images in a bounded queue, and a flag that the job moved."""

    def __init__(self, images: int) -> None:
        self._loop = asyncio.get_running_loop()
        self.partials: asyncio.Queue[Partial] = asyncio.Queue(images + PARTIAL_BUFFER)
        self.moved = asyncio.Event()

    def on_partial(self, image: int, partial: int, pixels: Any) -> None:
        self._soon(self._offer, (image, partial, pixels))

    def on_progress(self) -> None:
        if not self.moved.is_set():  # a flag already up says it all
            self._soon(self.moved.set)

    def _offer(self, item: Partial) -> None:
        if not self.partials.full():  # a slow reader loses partial images, never the final ones
            self.partials.put_nowait(item)

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


def _stamped(kind: str, data: dict[str, Any]) -> str:
    return _event(kind, {**data, "created_at": int(time.time())})


async def image_events(
    job: Job,
    feed: Feed,
    fields: dict[str, Any],
    compression: int | None,
    request_id: str,
    *,
    with_progress: bool = False,
) -> AsyncIterator[str]:
    """The events of `job`: its progress if asked for and its partial images as they come, then
    each finished image."""
    output_format = fields["output_format"]

    async def encoded(pixels: Any) -> str:
        return base64.b64encode(await encode_async(pixels, output_format, compression)).decode()

    done = asyncio.wrap_future(job.future)
    partial = asyncio.ensure_future(feed.partials.get())
    moved = asyncio.ensure_future(feed.moved.wait())
    said: dict[str, Any] = {}
    try:
        while True:
            if with_progress and (now := progress(job)) != said:
                said = now
                yield _stamped("diffshard.progress", now)
            finished, _ = await asyncio.wait({partial, moved, done}, return_when=asyncio.FIRST_COMPLETED)
            if moved in finished:
                feed.moved.clear()
                moved = asyncio.ensure_future(feed.moved.wait())
            if partial in finished:  # before the end: partial images handed over are all sent
                image, index, pixels = partial.result()
                partial = asyncio.ensure_future(feed.partials.get())
                data = {"b64_json": await encoded(pixels), "partial_image_index": index, "image_index": image}
                yield _stamped("image_generation.partial_image", {**data, **fields})
            elif done in finished:
                break
    finally:
        partial.cancel()
        moved.cancel()
    try:
        images = done.result()
    except Rejected as err:  # the same envelope a plain request would get
        yield _event("error", json.loads(domain_response(err, request_id).body))
        return
    if with_progress and (now := progress(job)) != said:
        yield _stamped("diffshard.progress", now)  # every step done
    for image, pixels in enumerate(images):
        seed = job.requests[image].seed
        data = {"b64_json": await encoded(pixels), "image_index": image, "seed": seed, "usage": USAGE}
        yield _stamped("image_generation.completed", {**data, **fields})
