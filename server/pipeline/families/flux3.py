"""FLUX.3 (`Flux3ModularPipeline`: true CFG against a negative prompt, 50 steps) and its
step-distilled flow map (`Flux3DistilledModularPipeline`: 16 steps, no guidance, each step told the
timestep it jumps to). Both are diffusers modular pipelines: their folders have a
`modular_model_index.json` (`server/pipeline/loading/modular.py`) and ship no scheduler, guider or
image processor, which the blocks make from their own configs, as here. Both run
`server/engine/denoisers/flux3.py` over the FLUX.2 VAE's normalized, patchified latents.

A prompt goes through the processor's chat template (one user turn) and is right-padded to a
multiple of 80 tokens, its padding at position 1; Qwen3-VL's hidden states of layers 4, 8, ..., 32,
side by side per token, are the context, padding included (the transformer takes no mask). The
schedule is the scheduler's constant shift (6.93) over sigmas from 1 to 1/steps.

Edits take one or more reference images on `/v1/images/edits`. One is kept whole: scaled down to
fit 4 MP, reflect-padded to the 16-pixel grid, and, unless `size` is given, the output is that
canvas cropped back to the image (`edit_crop`). Several are each scaled down to 1 MP and
center-cropped to the grid; the output takes the first's size. The blocks' prompt upsampler (a
separate language model) is not run: prompts are encoded as given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from server.engine.denoisers.blocks import REFERENCE_IDS, REFERENCES, TEXT_MASK
from server.engine.denoisers.flux3 import TEXT_TOKENS, image_ids
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline.families.base import TextEmbeddings, plain_guider
from server.pipeline.families.flux2 import FLUX2_VAE, Flux2
from server.requests.generation import GenerationRequest

MAX_TEXT_TOKENS = 8192  # Flux3TextEncoderStep's max_sequence_length: longer prompts are cut
DEFAULT_GUIDANCE = 3.5  # Flux3LoopDenoiser's guider's scale, where the folder ships no guider
# Qwen/Qwen3-VL-4B-Instruct, FLUX.3's text encoder (its text layers 2560 wide: 8 × 2560 = 20480)
QWEN3_VL_4B = {
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "vision_config": {
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "out_hidden_size": 2560,
    },
}


class Flux3(Flux2):
    """FLUX.3, the base model."""

    name: ClassVar[str] = "flux3"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux3ModularPipeline",)
    denoiser_class: ClassVar[type[nn.Module]] = Flux3Transformer2DModel
    default_steps: ClassVar[int] = 50  # Flux3SetTimestepsStep's
    takes_true_cfg: ClassVar[bool] = False  # guidance_scale is its true CFG's scale (the guider's)
    keep_precise: ClassVar[tuple[str, ...]] = ("x_embedders", "context_embedder", "norm_out", "proj_out")
    precise_rows: ClassVar[tuple[str, ...]] = (REFERENCE_IDS,)  # half-step positions
    hidden_layers: ClassVar[tuple[int, ...]] = (4, 8, 12, 16, 20, 24, 28, 32)  # text_encoder_out_layers
    edit_area: ClassVar[int | None] = None  # sized by `edit_size`
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(**QWEN3_VL_4B)),
        "vae": lambda: AutoencoderKLFlux2.from_config(FLUX2_VAE),
    }
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"flux3": {}}  # the class's defaults

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        return float(self.config.guider.get("guidance_scale", DEFAULT_GUIDANCE))

    def rows(self, request: GenerationRequest) -> int:
        """Two rows unless the scale is 1 (the guider's test: any other scale guides)."""
        return 1 if math.isclose(request.guidance_scale, 1.0) else 2

    lone_rows = 2

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        return request.guidance_scale

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {}

    def default_scheduler(self) -> Any:
        """The blocks' own: FlowMatchEulerDiscreteScheduler with their shift (6.93)."""
        from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep

        spec = next(s for s in Flux3SetTimestepsStep().expected_components if s.name == "scheduler")
        return spec.create()

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=device)

    # Prompts.

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """Flux3TextEncoderStep's embeddings of each prompt, those of one length encoded together,
        zero-padded to the longest with `TEXT_MASK` where lengths differ (`more_rows` trims each
        request's back to its own)."""
        encoder, tokenizer = encoders[0], tokenizers[0]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        lengths = [
            padded_length(len(ids))
            for ids in tokenizer(texts, truncation=True, max_length=MAX_TEXT_TOKENS).input_ids
        ]
        longest = max(lengths)
        context, mask = None, torch.zeros(len(texts), longest)
        for length in sorted(set(lengths)):
            at = [i for i, n in enumerate(lengths) if n == length]
            states = self._states(encoder, tokenizer, [texts[i] for i in at], length)
            if context is None:
                context = states.new_zeros(len(texts), longest, states.shape[-1])
            context[at, :length] = states
            mask[at, :length] = 1
        rows = {} if len(set(lengths)) == 1 else {TEXT_MASK: mask}
        return TextEmbeddings(context, rows=rows)

    def _states(self, encoder: nn.Module, tokenizer: Any, texts: list[str], length: int) -> torch.Tensor:
        device = next(encoder.parameters()).device
        tokens = tokenizer(
            texts,
            return_tensors="pt",
            padding="max_length",
            padding_side="right",
            truncation=True,
            max_length=length,
        )
        mask = tokens["attention_mask"].to(device)
        positions = torch.arange(length, device=device)[None].masked_fill(mask == 0, 1)  # the padding's at 1
        model = getattr(encoder, "model", encoder)  # without the LM head's logits
        states = model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=mask,
            position_ids=positions,
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states
        stacked = torch.stack([states[k] for k in self.hidden_layers], dim=2)  # [N, tokens, layers, dim]
        return stacked.flatten(2)

    def more_rows(self, own: TextEmbeddings, request: GenerationRequest) -> TextEmbeddings:
        """A request's rows cut to its longest prompt; masked only where its own rows differ."""
        mask = own.rows.get(TEXT_MASK)
        if mask is None:
            return own
        used = mask.sum(dim=1).to(torch.int64)
        width = int(used.max())
        rows = {**own.rows, TEXT_MASK: mask[:, :width]}
        if bool((used == width).all()):
            rows.pop(TEXT_MASK)
        return TextEmbeddings(own.context[:, :width], own.pooled, rows)

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)

    # Edits.

    def check_request(self, request: Any) -> None:
        if request.edit is not None and request.edit.mask is not None:
            raise InvalidRequest("mask", f"a {self.name} model edits by reference: it takes no mask")

    def _processor(self) -> Any:
        """The blocks' image processor, made as they make it (from its defaults: 16 px a token)."""
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

        return Flux3ImageProcessor()

    def _fitted(self, edit: Any) -> list[Any]:
        """The references as Flux3ProcessImagesInputStep sizes them before padding or cropping."""
        processor, images = self._processor(), [edit.image, *edit.more]
        if len(images) == 1:
            return [processor._resize_if_canvas_exceeds_area(images[0])]
        return [processor._resize_if_exceeds_area(image, 1024 * 1024) for image in images]

    def edit_size(self, edit: Any) -> tuple[int, int]:
        """The first reference's grid: a lone one's padded canvas, else its cropped size."""
        processor, first = self._processor(), self._fitted(edit)[0]
        if not edit.more:
            height, width = processor._get_canvas_height_width(first.height, first.width)
            return width, height
        multiple = processor.config.vae_scale_factor
        return first.width // multiple * multiple, first.height // multiple * multiple

    def edit_crop(self, edit: Any) -> tuple[int, int, int, int] | None:
        """A lone reference's box in its canvas (left, top, right, bottom): the output, sized by
        it, is cropped back to it (Flux3ImageProcessor.postprocess's `reference_crop`)."""
        if edit.more:
            return None
        processor, image = self._processor(), self._fitted(edit)[0]
        height, width = processor._get_canvas_height_width(image.height, image.width)
        return processor._get_fill_region(image, height, width)

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """Flux3VaeEncoderStep's latents of each reference (its posterior's mode, patchified and
        normalized), packed, at l = -1, -2, ...; the same on every row."""
        if request.edit is None:
            return {}, ()
        processor, device = self._processor(), next(vae.parameters()).device
        mode = "fill" if not request.edit.more else "crop"
        tokens, ids, layout = [], [], []
        for index, image in enumerate((request.edit.image, *request.edit.more)):
            pixels, _ = processor.preprocess(image, resize_mode=mode)
            latents = self.scale_latents(vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode())
            _, _, h, w = latents.shape
            tokens.append(latents.flatten(2).transpose(1, 2))
            ids.append(image_ids(h, w, torch.device("cpu"), mode=-(1 + index)))
            layout.append((h, w))
        conditioning = {REFERENCES: torch.cat(tokens, dim=1), REFERENCE_IDS: torch.cat(ids)[None]}
        return {k: v.expand(rows, -1, -1) for k, v in conditioning.items()}, tuple(layout)

    # Checks.

    def check_configs(self, where: str) -> None:
        super().check_configs(where)
        if refusal := plain_guider(self.config.guider):
            raise ModelFolderError(f"{where}/{refusal}")
        if bool(self.config.denoiser.get("flow_map")) != self.flow_map:
            kind = "a step-distilled (flow map)" if not self.flow_map else "not a flow-map"
            raise ModelFolderError(
                f"{where}: its transformer is {kind} model; a {self.pipeline_classes[0]} folder needs "
                f"flow_map {self.flow_map} in transformer/config.json"
            )

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if not encoders:
            raise ModelFolderError(f"a {self.name} folder needs text_encoder (Qwen3-VL) and its tokenizer")
        text = encoders[0].config.get_text_config()
        if int(text.num_hidden_layers) < max(self.hidden_layers):
            raise ModelFolderError(
                f"the text encoder has {text.num_hidden_layers} layers; {self.name} reads layers "
                f"{self.hidden_layers}"
            )
        super().check(encoders, denoiser)


class Flux3Distilled(Flux3):
    """FLUX.3 distilled: a flow map, 16 steps, no guidance."""

    name: ClassVar[str] = "flux3-distilled"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux3DistilledModularPipeline",)
    default_steps: ClassVar[int] = 16  # Flux3DistilledAutoBlocks' set_timesteps
    takes_guidance: ClassVar[bool] = False  # it samples without guidance
    lone_rows = 1
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"flux3-distilled": {"flow_map": True}}

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        return 1.0

    def rows(self, request: GenerationRequest) -> int:
        return 1

    @property
    def flow_map(self) -> bool:
        return True


def padded_length(tokens: int) -> int:
    """A prompt's length once padded: its tokens up to a multiple of 80, at most 8192."""
    return min(math.ceil(tokens / TEXT_TOKENS) * TEXT_TOKENS, MAX_TEXT_TOKENS)
