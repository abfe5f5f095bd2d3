"""The VAE within bounded memory: decoding in calls of at most DECODE_PIXELS, in tiles above its
tile size (`--vae-tiling`), and the decoder's peak activation memory counted from its config.

Tiles are diffusers' own (`AutoencoderKL.enable_tiling()`): latents wider or taller than the VAE's
tile (its config's `sample_size` in pixels: 512 for SD-1.5, 1024 for SDXL, SD3 and FLUX.1)
decode in tiles of that size overlapping by a quarter, blended; an edit's image that large
encodes in tiles too. A tile bounds the decoder's activations whatever the image's size, for
up to ~1.8x its work (the overlaps) and an image a little off the untiled one (a tile sees its own
latents only).

`--vae-tiling`:
- `off`: never; every image is diffusers' default pipeline's.
- `on`: diffusers' rule above.
- `auto` (default): `on` where the VAE's device has a memory budget and one image of the
  largest size a request may ask, decoded whole, is predicted over the activation reserve the
  plan keeps there for the denoiser (the decoder would bound `max_pixels`, not the denoiser),
  else `off`: images stay diffusers' default pipeline's wherever memory allows. (`auto` as
  diffusers' rule would be `on` by another name: under it no image at or below the tile tiles.)
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from server.engine.hardware.devices import format_bytes
from server.engine.planning.live import peak_bytes

log = logging.getLogger("diffshard")

DECODE_PIXELS = 1024 * 1024  # pixels one VAE call decodes at most (at least one image)
OVERLAP = 0.25  # diffusers' tile_overlap_factor
ATTENTION_LIVE = 7  # tensors of the mid block's attention alive at once: input, norm, q, k, v, out, copy


class VaeTiling(enum.StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


def parse_vae_tiling(value: object) -> VaeTiling:
    text = str(getattr(value, "value", value)).strip().lower()
    if text not in set(VaeTiling):
        raise ValueError(f"write auto, on or off, got {value!r}")
    return VaeTiling(text)


def images_per_call(width: int, height: int, frames: int | None = None) -> int:
    """Images of this size one VAE call decodes: DECODE_PIXELS' worth, at least one. Tiled, the
    same: diffusers' `tiled_decode` runs each tile on the call's whole batch, so its activations
    are images × tile, under this bound, and the tiles it keeps until blended (3 channels, full
    size) stay bounded too. A video (`frames`): one clip a call, as the plan counts one clip's
    decode peak; and a clip's pixels must not depend on its batch-mates (the tiny Wan's causal
    3D VAE decoded a clip 0.021 apart beside another than alone, on an AVX2-only EPYC)."""
    if frames is not None:
        return 1
    return max(1, DECODE_PIXELS // (width * height))


def set_tiling(vae: nn.Module, on: bool) -> nn.Module:
    """`vae` with diffusers' tiling on or off: its decode and encode then tile as its pipelines'."""
    if on:
        vae.enable_tiling()
    elif hasattr(vae, "disable_tiling"):
        vae.disable_tiling()
    return vae


@dataclass(frozen=True)
class VaeShape:
    """What the count reads of an AutoencoderKL's config (diffusers' defaults where unset)."""

    channels: tuple[int, ...]  # block_out_channels; the decoder's up blocks run them reversed
    layers: int  # layers_per_block: each up block runs one more resnet
    latent_channels: int
    out_channels: int
    attention: bool  # the mid block's
    post_quant_conv: bool
    tile: int  # tile_sample_min_size, pixels

    @classmethod
    def of(cls, config: Mapping[str, Any], default_tile: int) -> VaeShape:
        tile = config.get("sample_size") or default_tile
        layers = config.get("layers_per_block", 1)  # LTX-2's VAE names them block by block: the most
        return cls(
            tuple(config.get("block_out_channels", (64,))),
            max(layers) if isinstance(layers, list | tuple) else int(layers),
            int(config.get("latent_channels", 4)),
            int(config.get("out_channels", 3)),
            bool(config.get("mid_block_add_attention", True)),
            bool(config.get("use_post_quant_conv", True)),
            int(tile[0] if isinstance(tile, list | tuple) else tile),
        )

    @property
    def factor(self) -> int:
        return 2 ** (len(self.channels) - 1)

    @property
    def tile_latent(self) -> int:
        return self.tile // self.factor  # diffusers' tile_latent_min_size


def tiles(vae: VaeShape, height: int, width: int) -> bool:
    """Whether diffusers' rule tiles a `height` × `width` image (once tiling is on)."""
    return max(height, width) // vae.factor > vae.tile_latent


def decoder_peak(
    vae: VaeShape, height: int, width: int, images: int = 1, element_bytes: int = 4, *, tiled: bool
) -> int:
    """Bytes the decoder holds at its peak decoding `images` latents of a `height` × `width` image
    (the latents included; its weights not), eager and in inference mode, tiled as diffusers'
    rule tiles it (if `tiled`) or whole. Counted, not run: a tensor lives while a name holds it
    (diffusers' forwards read line by line), attention is memory-efficient (no score matrix)."""
    h, w = height // vae.factor, width // vae.factor
    latents = vae.latent_channels * h * w
    if not tiled or not tiles(vae, height, width):
        return images * element_bytes * (latents * (1 + vae.post_quant_conv) + _decoder(vae, h, w))
    size, stride = vae.tile_latent, max(1, int(vae.tile_latent * (1 - OVERLAP)))  # a one-latent tile: 1
    kept = peak = 0  # the decoded tiles, kept until they are blended
    for i in range(0, h, stride):
        for j in range(0, w, stride):
            th, tw = min(size, h - i), min(size, w - j)
            tile = vae.latent_channels * th * tw * vae.post_quant_conv  # post_quant_conv's output
            peak = max(peak, latents + kept + tile + _decoder(vae, th, tw))
            kept += vae.out_channels * th * tw * vae.factor**2
    image = vae.out_channels * height * width
    peak = max(peak, latents + kept + 2 * image)  # the blended rows, then their concatenation
    return images * element_bytes * peak


def _decoder(vae: VaeShape, h: int, w: int) -> int:
    """Elements `Decoder.forward` holds at its peak on one image's `h` × `w` latents, beyond its
    input. Each up block's input stays named by the decoder while the block runs."""
    up = vae.channels[::-1]
    pixels, mid = h * w, up[0]
    # conv_in; the mid block: resnet, attention, resnet, conv_in's output named throughout
    peak = pixels * mid * max(4, 1 + ATTENTION_LIVE * vae.attention, 5)
    for i, out in enumerate(up):
        into = up[max(0, i - 1)]  # the block's input channels: the previous block's output
        peak = max(peak, pixels * _resnet(into, out))
        if vae.layers > 0:  # a later resnet, beside the block's input
            peak = max(peak, pixels * (into + 4 * out))
        if i < len(up) - 1:  # the upsampler: its input, nearest x2, conv; beside the block's input
            peak = max(peak, pixels * (into + out + 8 * out))
            pixels *= 4
    # conv_norm_out, silu, conv_out
    return max(peak, pixels * 2 * up[-1], pixels * (up[-1] + vae.out_channels))


def _resnet(into: int, out: int) -> int:
    """Channels alive at once in a ResnetBlock2D, its input included: norm1 + silu, conv1, and the
    sum `(input + shortcut(input) + conv2) / scale` (a shortcut conv when channels change)."""
    return max(3 * into, 2 * into + out, into + 4 * out if into != out else 4 * out)


@dataclass(frozen=True)
class DecoderMemory:
    """The decoder's predicted peak for one image of the largest size a request may ask, whole and
    in tiles, and whether `--vae-tiling` tiles it: what `plan` prints. A call decodes `images` of
    them (its peaks that many times these)."""

    side: int
    images: int  # in one VAE call (images_per_call)
    tile: int  # pixels
    untiled_bytes: int  # one image
    tiled_bytes: int
    reserve_bytes: int | None  # the plan's activation reserve on the VAE's device; None: no budget
    setting: str
    tiling: bool
    frames: int | None = None  # a video VAE's: the clip counted (whole only: tiles are not counted)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.frames is not None:
            whole = format_bytes(self.untiled_bytes) if self.untiled_bytes else "not counted,"
            line = (
                f"VAE decoder at {self.side}², {self.frames} frames: peak {whole} whole (tiles not counted)"
            )
            return f"{line}; --vae-tiling {self.setting}: {self._choice()}"
        whole, tiled = format_bytes(self.untiled_bytes), format_bytes(self.tiled_bytes)
        line = f"VAE decoder at {self.side}²: peak {whole} an image whole, {tiled} in {self.tile}² tiles"
        if self.images > 1:
            n = self.images
            line += (
                f" ({n} a call: {format_bytes(n * self.untiled_bytes)}, {format_bytes(n * self.tiled_bytes)})"
            )
        return f"{line}; --vae-tiling {self.setting}: {self._choice()}"

    def _choice(self) -> str:
        why = "as set"
        if self.setting == VaeTiling.AUTO and self.reserve_bytes is None:
            why = "the VAE's device has no memory budget"
        elif self.setting == VaeTiling.AUTO:
            over = "over" if self.tiling else "within"
            what = "a clip's" if self.frames is not None else "an image's"
            why = f"{what} whole peak is {over} the {format_bytes(self.reserve_bytes)} activation reserve"
        return f"{'tiles' if self.tiling else 'whole'} ({why})"


_VIDEO_PEAKS: dict[tuple, int] = {}  # (config, side, latent frames, dtype) → bytes, this process's
COUNTED_LATENT_FRAMES = 24  # longer clips: extrapolated from the counts at half this and this


def video_decoder_peak(config: Mapping[str, Any], side: int, latent_frames: int, dtype: torch.dtype) -> int:
    """Bytes Wan's VAE (`AutoencoderKLWan`) holds decoding one clip of `latent_frames` at `side`²,
    whole: its causal 3D convolutions run a latent frame at a time, each keeping the last two
    frames of its input, while the clip's frames gather. Counted by running it on the meta device
    (`live.py`): ~1.5 s for Wan's 21 latent frames at 624². Past a few frames the peak grows by
    the same bytes a frame (the gathered frames; measured on the tiny Wan VAE: equal steps from 5
    to 33 latent frames), so a clip longer than COUNTED_LATENT_FRAMES is extrapolated from two
    counts instead of run: the longest clip a plan admits is hundreds of latent frames."""
    if latent_frames > COUNTED_LATENT_FRAMES:
        low, high = COUNTED_LATENT_FRAMES // 2, COUNTED_LATENT_FRAMES
        at_low, at_high = (video_decoder_peak(config, side, n, dtype) for n in (low, high))
        return at_high + (at_high - at_low) * (latent_frames - high) // (high - low)
    from diffusers import AutoencoderKLWan

    key = (json.dumps(dict(config), sort_keys=True, default=str), side, latent_frames, str(dtype))
    if key not in _VIDEO_PEAKS:  # `serve` plans, then loads: counted once
        with torch.device("meta"):
            vae = AutoencoderKLWan.from_config(dict(config)).eval()
        if dtype != torch.float32:  # built in float32 (diffusers warns of a cast it need not make)
            vae = vae.to(dtype)
        factor = 2 ** len(config["temperal_downsample"])
        shape = (1, vae.config.z_dim, latent_frames, side // factor, side // factor)
        latents = torch.empty(shape, device="meta", dtype=dtype)
        _VIDEO_PEAKS[key] = peak_bytes(lambda: vae.decode(latents).sample)
    return _VIDEO_PEAKS[key]


def decoder_memory(
    config: Mapping[str, Any],
    *,
    side: int,
    default_tile: int,
    dtype: torch.dtype,
    setting: VaeTiling,
    reserve: int | None,
    frames: int | None = None,
) -> DecoderMemory:
    """The decoder's peak for one `side`² image whole and tiled, from the VAE's `config`, and
    whether `setting` tiles. auto: where one image's whole peak is over `reserve` (None: the
    device has no budget, nothing to keep under); a call of many images is not weighed, as fewer
    images a call would bound it and tiles would not."""
    if "temperal_downsample" in config:  # a video VAE (diffusers' spelling): counted on meta
        clip = frames or 1
        latent_frames = (clip - 1) // 2 ** sum(config["temperal_downsample"]) + 1
        try:
            whole = video_decoder_peak(config, side, latent_frames, dtype)
        except Exception as err:  # a VAE the meta run cannot take: said, and the start goes on
            log.warning("the video VAE's peak could not be counted (%s): auto decodes it whole", err)
            whole = 0
        over = reserve is not None and whole > reserve
        tiling = setting == VaeTiling.ON or (setting == VaeTiling.AUTO and over)
        return DecoderMemory(side, 1, default_tile, whole, 0, reserve, str(setting), tiling, frames=clip)
    vae = VaeShape.of(config, default_tile)
    if dtype == torch.float16 and config.get("force_upcast", False):
        dtype = torch.float32  # as the Pipeline upcasts such VAEs
    whole = decoder_peak(vae, side, side, 1, dtype.itemsize, tiled=False)
    tiled = decoder_peak(vae, side, side, 1, dtype.itemsize, tiled=True)
    over = reserve is not None and whole > reserve
    tiling = setting == VaeTiling.ON or (setting == VaeTiling.AUTO and over)
    images = images_per_call(side, side)
    return DecoderMemory(side, images, vae.tile, whole, tiled, reserve, str(setting), tiling)
