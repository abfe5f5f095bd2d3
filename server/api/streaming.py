"""`stream: true` on /v1/images/generations: OpenAI's server-sent events.

    event: image_generation.partial_image
    data: {"type": "image_generation.partial_image", "b64_json": ..., "partial_image_index": 0,
           "image_index": 0, "created_at": ..., "size": "64x64", "quality": "auto",
           "background": "opaque", "output_format": "png"}

then one `image_generation.completed` per image (the same fields, `usage`, no partial index).
A partial image is the model's own prediction of the finished image at evenly spaced steps.
With n > 1, `image_index` (diffshard's extension; the SDK keeps unknown fields) says which
image an event is about. An error after the stream began is an `error` event with OpenAI's
envelope, which the SDK raises.

The step loop hands partial images over without waiting: each stream buffers at most
`PARTIAL_BUFFER` of them and drops the newest beyond that, so a slow reader never stalls other
requests. A client that goes away cancels its request at the next step.
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

EVENTS = ("image_generation.partial_image", "image_generation.completed", "error")
PARTIAL_BUFFER = 8
# diffshard counts no tokens; the SDK's completed event has a usage object
USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "input_tokens_details": {}}

Partial = tuple[int, int, Any]  # image index, partial index, [H, W, 3] image


def partial_receiver() -> tuple[asyncio.Queue[Partial], Callable[[int, int, Any], None]]:
    """A bounded queue on this event loop, and the callback the step loop's thread feeds it with."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Partial] = asyncio.Queue(PARTIAL_BUFFER)

    def offer(item: Partial) -> None:
        if not queue.full():  # a slow reader loses partial images, never the final ones
            queue.put_nowait(item)

    def receive(image: int, partial: int, pixels: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed (the server stops): nobody listens
            loop.call_soon_threadsafe(offer, (image, partial, pixels))

    return queue, receive


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def image_events(
    job: Job,
    partials: asyncio.Queue[Partial],
    fields: dict[str, Any],
    compression: int | None,
    request_id: str,
) -> AsyncIterator[str]:
    """The events of `job`: its partial images as they come, then each finished image."""
    output_format = fields["output_format"]

    async def encoded(pixels: Any) -> str:
        return base64.b64encode(await encode_async(pixels, output_format, compression)).decode()

    done = asyncio.wrap_future(job.future)
    while True:
        waiting = asyncio.ensure_future(partials.get())
        finished, _ = await asyncio.wait({waiting, done}, return_when=asyncio.FIRST_COMPLETED)
        if waiting not in finished:
            waiting.cancel()
            break
        image, index, pixels = waiting.result()
        data = {"b64_json": await encoded(pixels), "partial_image_index": index, "image_index": image}
        yield _event("image_generation.partial_image", {**data, "created_at": int(time.time()), **fields})
    try:
        images = done.result()
    except Rejected as err:  # the same envelope a plain request would get
        yield _event("error", json.loads(domain_response(err, request_id).body))
        return
    for image, pixels in enumerate(images):
        data = {"b64_json": await encoded(pixels), "image_index": image, "usage": USAGE}
        yield _event("image_generation.completed", {**data, "created_at": int(time.time()), **fields})
