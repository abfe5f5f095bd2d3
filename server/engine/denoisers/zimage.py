"""Z-Image's transformer (`diffusers.ZImageTransformer2DModel`) as blocks: a single-stream DiT.

forward takes lists (a latent [C, 1, H, W] and a caption's tokens per row) and pads inside; here
a call's rows are one tensor of one size, as the engine batches them, and `begin` makes what
forward's `patchify_and_embed` and `_prepare_sequence` make from such a list:

- the image: 2x2 patches (features ordered patch row, patch column, channel), padded to a
  multiple of 32 tokens (`SEQ_MULTI_OF`) with the learnt `x_pad_token`;
- each caption: its own tokens (the text mask says how many), padded to a multiple of 32 with
  `cap_pad_token` (attended to, as diffusers does), then to the longest row's with tokens masked
  out (diffusers' batch padding);
- positions (3 axes): caption token k at (1 + k, 0, 0); the image's at (padded caption + 1, row,
  column), so they differ by row where captions differ; padding tokens at (0, 0, 0).

The `embed` block embeds them and the timestep (`t_scale` times the pipeline's (1000 − t)/1000).
Then the `noise_refiner` blocks refine the image tokens, the `context_refiner` blocks the caption
tokens (unmodulated), the last of them joins both into one sequence ([image, caption], the
rotary frequencies and mask with them), and the 30 `layers` run on it: one block each. The final
layer ends it; `end` keeps the image tokens and negates them, as ZImagePipeline negates the
model's output before the scheduler's step (the model predicts x0 − noise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    TEXT_MASK,
    BlockCall,
    CacheBoundary,
    Cut,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    TensorSplit,
    flow_timesteps,
    stacked_layout,
)
from server.engine.denoisers.dit import dit_boundary, token_rows
from server.engine.denoisers.qwenimage import TEXT_TOKENS

MULTIPLE = 32  # diffusers' SEQ_MULTI_OF: image and caption tokens are padded to a multiple of it
PATCH = "2-1"  # the embedder and final layer of 2x2 patches, one frame (the pipeline's)


class ZImageTransformerSpec:
    """`diffusers.ZImageTransformer2DModel` in its basic (text-to-image) mode."""

    EMBEDDING = ("t_embedder", "all_x_embedder", "cap_embedder", "x_pad_token", "cap_pad_token")
    OUTPUT = ("all_final_layer",)

    def native_latent(self, model: nn.Module) -> int:
        return 128  # ZImagePipeline's default 1024 px

    def layout(self, model: nn.Module) -> Layout:
        return stacked_layout(
            model, self.EMBEDDING, ("noise_refiner", "context_refiner", "layers"), self.OUTPUT
        )

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        sample = torch.randn(batch, config.in_channels, latent_size, latent_size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        context = torch.randn(batch, TEXT_TOKENS, config.cap_feat_dim, dtype=dtype, device=device)
        mask = torch.ones(batch, TEXT_TOKENS, dtype=dtype, device=device)
        return DenoiserInputs(sample, timestep, context, {TEXT_MASK: mask})

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, (TEXT_MASK,), "Z-Image")
        sample, mask = rows.pop("sample"), rows.pop(TEXT_MASK, None)
        b, c, h, w = sample.shape
        image = sample.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)
        rows["image"] = image.reshape(b, (h // 2) * (w // 2), 4 * c)
        tokens = image_tokens = (h // 2) * (w // 2)
        image_pad = -image_tokens % MULTIPLE
        # the call's columns come cut on the host to those its longest caption uses, bucketed
        # (`pipeline/steps/state.py`), the rest masked as diffusers masks its batch padding; per row, its
        # caption's tokens and those padded to a multiple of MULTIPLE, counted on the device
        # (read here, they waited for the GPU every call)
        lengths = caption_lengths(mask, rows["context"])[:, None]
        padded = lengths + -lengths % MULTIPLE
        columns = -(-rows["context"].shape[1] // MULTIPLE) * MULTIPLE
        rows["context"] = _columns(rows["context"], columns)
        k = torch.arange(columns, device=sample.device)
        rows["cap_pad"], rows["cap_mask"] = (k >= lengths) & (k < padded), k < padded
        rows["timestep"] = (1000 - rows["timestep"].float()) / 1000  # ZImagePipeline's, in float32
        ids = image_ids(h // 2, w // 2, 0, image_pad, sample.device).repeat(b, 1, 1)
        ids[:, :image_tokens, 0] = (padded + 1).to(ids.dtype)  # each row's frame: after its caption
        rows["image_rotary"] = model.rope_embedder(ids.flatten(0, 1)).unflatten(0, (b, -1))
        text = torch.stack([k + 1, torch.zeros_like(k), torch.zeros_like(k)], dim=-1).to(torch.int32)
        rows["text_rotary"] = model.rope_embedder(text).expand(b, -1, -1)
        return Flow(rows, {"size": (h, w), "tokens": tokens, "image_pad": image_pad})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed if len(model.context_refiner) else embed_and_join)}
        calls.update(
            (f"noise_refiner.{i}", BlockCall(b, refine_image)) for i, b in enumerate(model.noise_refiner)
        )
        last = len(model.context_refiner) - 1
        calls.update(
            (f"context_refiner.{i}", BlockCall(b, refine_text_and_join if i == last else refine_text))
            for i, b in enumerate(model.context_refiner)
        )
        calls.update((f"layers.{i}", BlockCall(b, layer)) for i, b in enumerate(model.layers))
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        (h, w), hidden = flow.shared["size"], flow.rows["hidden"]
        b, c = hidden.shape[0], model.out_channels
        image = hidden[:, : flow.shared["tokens"]].reshape(b, h // 2, w // 2, 2, 2, c)
        return -image.permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)  # the pipeline's −model output

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        return dit_boundary(model.layers, "layers")

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """The main layers on a slice of the joined tokens, with their rotary frequencies and
        mask (per row: they differ by caption). The refiners run whole on every rank."""
        blocks = frozenset(f"layers.{i}" for i in range(len(model.layers)))
        return SequenceSplit(blocks, {"hidden": 1, "rotary": 1, "mask": 1})

    def tensor(self, model: nn.Module) -> TensorSplit:
        """Each main layer's attention by heads, its SwiGLU feed-forward (w1 and w3 by features,
        w2 summed) and its modulation gathered; the refiners run whole on every rank."""
        cuts = {f"layers.*.attention.{p}": Cut.COLUMN for p in ("to_q", "to_k", "to_v")}
        cuts |= {"layers.*.attention.to_out.0": Cut.ROW, "layers.*.feed_forward.w2": Cut.ROW}
        cuts |= {f"layers.*.feed_forward.{w}": Cut.COLUMN for w in ("w1", "w3")}
        cuts |= {"layers.*.adaLN_modulation.0": Cut.GATHERED}
        return TensorSplit(self.sequence(model).blocks, cuts)


def caption_lengths(mask: torch.Tensor | None, context: torch.Tensor) -> torch.Tensor:
    """[rows] each row's caption tokens (they come first): every column where there is no mask."""
    if mask is None:
        return torch.full((context.shape[0],), context.shape[1], device=context.device)
    return mask.to(torch.bool).sum(dim=1)


def _columns(context: torch.Tensor, columns: int) -> torch.Tensor:
    """`context` cut or zero-padded to `columns` tokens."""
    if columns <= context.shape[1]:
        return context[:, :columns]
    return torch.nn.functional.pad(context, (0, 0, 0, columns - context.shape[1]))


def image_ids(h: int, w: int, frame: int, pad: int, device: torch.device) -> torch.Tensor:
    """[h · w + pad, 3] positions of the image tokens (at `frame`) and of their padding (zeros)."""
    rows, columns = torch.meshgrid(
        torch.arange(h, device=device, dtype=torch.int32),
        torch.arange(w, device=device, dtype=torch.int32),
        indexing="ij",
    )  # on `device`: no copy from the host a call
    ids = torch.stack([torch.full_like(rows, frame), rows, columns], dim=-1).reshape(-1, 3)
    return torch.cat([ids, torch.zeros(pad, 3, dtype=ids.dtype, device=device)])


# The blocks' calls: fn(owner, rows, shared) → rows, as ZImageTransformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    image = model.all_x_embedder[PATCH](rows["image"])
    b, pad = image.shape[0], shared["image_pad"]
    if pad:
        image = torch.cat([image, model.x_pad_token.to(image).expand(b, pad, -1)], dim=1)
    temb = model.t_embedder(rows["timestep"] * model.t_scale).type_as(image)
    context = model.cap_embedder(rows["context"])
    # the pad tokens are root parameters (`TensorPart`s): as Wan's table, read on the flow's device
    context = torch.where(rows["cap_pad"][..., None], model.cap_pad_token.to(context), context)
    return {**rows, "image": image, "temb": temb, "context": context}


def refine_image(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {**rows, "image": block(rows["image"], None, rows["image_rotary"], rows["temb"])}


def refine_text(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {**rows, "context": block(rows["context"], rows["cap_mask"], rows["text_rotary"])}


def joined(rows: dict[str, Any]) -> dict[str, Any]:
    """One sequence per row, [image, caption] (diffusers' basic mode), with its positions and mask."""
    image, text_mask = rows["image"], rows["cap_mask"]
    mask = None
    if text_mask is not None:
        mask = torch.cat([text_mask.new_ones(image.shape[:2]), text_mask], dim=1)
    return {
        "hidden": torch.cat([image, rows["context"]], dim=1),
        "temb": rows["temb"],
        "rotary": torch.cat([rows["image_rotary"], rows["text_rotary"]], dim=1),
        "mask": mask,
    }


def refine_text_and_join(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return joined(refine_text(block, rows, shared))


def embed_and_join(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return joined(embed(model, rows, shared))


def layer(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {**rows, "hidden": block(rows["hidden"], rows["mask"], rows["rotary"], rows["temb"])}


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {"hidden": model.all_final_layer[PATCH](rows["hidden"], c=rows["temb"])}
