"""What one request may ask and gets when it names nothing, and how the step loop takes work:
batching, overload, deadlines. What serving's `Limits`, the request defaults and the `Service`
are built from."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from server.requests.step_cache import StepCache
from server.settings.values import Concern, StepCacheSetting


class LimitSettings(Concern):
    title = "limits on one request, its defaults, and the step loop (batching, overload, deadlines)"

    # Limits on one request.
    max_n: int = Field(10, ge=1, le=100, description="images per request")
    max_steps: int = Field(100, ge=1, le=1000, description="num_inference_steps")
    max_pixels: int | None = Field(
        None, ge=64, description="width x height of one image (default: 4x the model's native area)"
    )
    max_work: float = Field(
        1000,
        gt=0,
        description="n x steps x pixels (x a video's latent frames) / native pixels of one "
        "request (native-image steps; a video model's default: x its default clip's latent frames)",
    )
    max_prompt_chars: int = Field(2000, ge=1, description="characters of prompt or negative_prompt")
    max_body_bytes: int = Field(
        64 * 1024, ge=1024, description="bytes of a request body (edits: beside their images)"
    )
    max_image_bytes: int = Field(
        4 * 2**20, ge=1024, description="bytes of one image or mask sent to /v1/images/edits"
    )
    max_image_pixels: int | None = Field(
        None, ge=64, description="width x height of one image sent to edit (default: 4x max_pixels)"
    )
    max_edit_images: int = Field(4, ge=1, le=16, description="images one edit request may send")

    # What a request naming none gets.
    default_steps: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="num_inference_steps of a request naming none (default: the folder's "
        "recommended.json, else its pipeline's: Z-Image-Turbo 8, a Z-Image base folder 50)",
    )
    default_guidance: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="guidance_scale of a request naming none (default: the folder's recommended.json, "
        "else its pipeline's: Z-Image-Turbo 0, a Z-Image base folder 5)",
    )
    step_cache: StepCacheSetting = Field(
        StepCache(),
        description="a request's step_cache when it sends none: off, deep (UNets), first_block "
        '(MMDiTs), or JSON, e.g. {"policy": "deep", "interval": 3}; off keeps diffusers\' images',
    )

    # The step loop: batching, overload, deadlines.
    max_batch: int = Field(
        16, ge=1, le=1024, description="denoiser rows per batched step (2 per guided image)"
    )
    step_budget: Annotated[float, Field(gt=0)] | Literal["auto", "off"] = Field(
        "auto",
        description="work one batched step may take, in rows of the model's native size (rows x "
        "pixels / native pixels; a larger request runs alone); auto: the knee the planner's costs "
        "predict (where doubling rows adds < 10% rows/s); off: only --max-batch",
    )
    max_queue: int = Field(64, ge=1, description="requests waiting for a place; beyond it: 503")
    max_queue_per_key: int | None = Field(
        None,
        ge=1,
        description="requests one API key may have waiting; beyond it: 429 (default: half of max_queue)",
    )
    max_background_queue: int | None = Field(
        None,
        ge=1,
        description="background requests (Batch API lines, priority background) waiting for a place, "
        "apart from max_queue; beyond it: 503 (default: 4 x max_queue)",
    )
    request_timeout_s: float = Field(300, gt=0, description="a request's deadline from arrival; past it: 504")
    video_timeout_s: float = Field(
        3600,
        gt=0,
        description="a video job's deadline, from when a runner takes it from the store (waiting in the "
        "step loop's line counts, waiting in the store does not); past it: failed",
    )
    step_timeout_s: float = Field(
        120,
        gt=0,
        description="a step of max_batch native-size rows running longer than this (more work: "
        "proportionally longer) fails /readyz until it returns; 4x longer fails /livez",
    )
    failures_unready: int = Field(
        3, ge=1, description="consecutive failed steps (not out-of-memory) that fail /readyz"
    )
    inject_faults: bool = Field(
        False,
        description="tests only: [[fail]], [[oom]], [[hang]], [[slow]], [[decode]] or [[kill]] in a prompt "
        "fails there",
    )

    @property
    def key_queue_limit(self) -> int:
        """Requests one API key may have waiting (`max_queue_per_key`, default half the line)."""
        return self.max_queue_per_key or max(1, self.max_queue // 2)

    @property
    def edit_body_bytes(self) -> int:
        """An edit's body: its images and mask at their limit, beside the other fields."""
        return (self.max_edit_images + 1) * self.max_image_bytes + self.max_body_bytes
