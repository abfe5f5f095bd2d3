"""One image (or video) to generate, the defaults a model fills it with, and the word a client
gets at sizes far from the model's native one. The checks against a model are the pipeline's
(`server/pipeline/resolve.py`); the service's policy limits, `server/serving/limits.py`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image

from server.requests.clip import Clip
from server.requests.control import Control
from server.requests.edit import Edit
from server.requests.guidance import AudioVideoGuidance
from server.requests.step_cache import OFF, StepCache

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes any int below this
MAX_MODEL_STEPS = 1000  # diffusers' schedulers train on 1000 timesteps
KINDS = ("generation", "img2img", "inpainting")


@dataclass(frozen=True)
class GenerationRequest:
    """One image. Unset fields take the pipeline's defaults (`Pipeline.defaults`)."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 0
    steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = (
        None  # two experts (Wan 2.2 A14B): the low-noise one's; None: guidance_scale
    )
    scheduler: str | None = None
    width: int | None = None
    height: int | None = None
    partial_images: int = 0  # previews of the predicted clean image, at evenly spaced steps
    deterministic: bool = False  # its calls run alone: its bytes do not depend on the batch
    lora: tuple[tuple[str, float], ...] = ()  # adapters and their scales, in order (pipeline's adapters.py)
    edit: Edit | None = None  # the image an edit starts from (edit.py); None: text to image
    true_cfg_scale: float | None = None  # true CFG (FLUX.1, Qwen-Image): with negative_prompt when > 1
    step_cache: StepCache | None = None  # reuse of the last steps' features (step_cache.py)
    frames: int | None = None  # a video's frames (video families only); None: an image
    latent_frames: int = 1  # what a video weighs in work: its latent frames (set with the defaults)
    control: tuple[Control, ...] = ()  # ControlNets steering its rows (control.py), summed
    fps: float | None = None  # a video's frames a second, for models that condition on it (LTX-2)
    guidance: AudioVideoGuidance | None = None  # a video-and-sound model's other scales (guidance.py)
    # the box (left, top, right, bottom) of the output its decoded image is cropped to: an edit its
    # family sizes by a padded canvas, where the request named no size (FLUX.3's lone reference)
    crop: tuple[int, int, int, int] | None = None
    # image-to-video's first frame (RGB, resized to the video's size); compared by the others' fields
    reference: Image.Image | None = field(default=None, compare=False)

    @property
    def output_size(self) -> str:
        """ "WIDTHxHEIGHT" of what it returns: its size, or its crop's."""
        if self.crop is not None:
            left, top, right, bottom = self.crop
            return f"{right - left}x{bottom - top}"
        return f"{self.width}x{self.height}"

    @property
    def kind(self) -> str:
        """generation, img2img or inpainting: one of KINDS (a bounded metric label)."""
        if self.edit is None:
            return "generation"
        return "img2img" if self.edit.mask is None else "inpainting"

    @property
    def resolved(self) -> bool:
        fields = (self.steps, self.guidance_scale, self.scheduler, self.width, self.height, self.step_cache)
        return None not in fields


@dataclass(frozen=True)
class Defaults:
    steps: int
    guidance_scale: float
    scheduler: str
    size: int  # native image side in pixels
    size_multiple: int = 8  # an edit's default size: its image's, rounded down to this
    step_cache: StepCache = OFF  # --step-cache
    clip: Clip | None = None  # a video family's (clip.py): its default frames and frames' rule
    video_size: tuple[int, int] | None = None  # (width, height) of a video that names none; None: size²
    true_cfg_scale: float = 1.0  # the family's (QwenImagePipeline's 4.0): on with a negative prompt
    edit_size: Callable[[Edit], tuple[int, int]] | None = None  # an edit's default size (its family's)
    edit_crop: Callable[[Edit], tuple[int, int, int, int] | None] | None = None  # and its crop (`crop`)


# Past this share of the native area (or under its inverse) a model draws what it never trained on:
# SD-1.5 at 768x768 (2.25x) repeats its subject; SD-1.5 at 768x512 (1.5x) is common practice.
TRAINED_AREA = 1.5


def size_warning(request: GenerationRequest, defaults: Defaults) -> str | None:
    """A word for the client when the request's size is far from the model's native one (where
    images often repeat or lose their subject); None at sizes near it. A video's native size is
    its model's default clip's (Wan: 832x480), where it has one."""
    assert request.width is not None and request.height is not None  # resolved
    width, height = defaults.size, defaults.size
    if request.frames is not None and defaults.video_size is not None:
        width, height = defaults.video_size
    area = request.width * request.height / (width * height)
    if 1 / TRAINED_AREA <= area <= TRAINED_AREA:
        return None
    return (
        f"{request.width}x{request.height} is {area:.3g}x the area this model was trained at "
        f"({width}x{height}): images may repeat or lose their subject; the native size works best"
    )
