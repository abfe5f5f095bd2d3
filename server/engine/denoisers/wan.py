"""Wan 2.x's video transformer (`diffusers.WanTransformer3DModel`) as blocks.

A call's sample is [rows, 16, frames, h, w]: a video's latent frames are one row, and its
tokens are every frame's patches (1×2×2), so self-attention spans the whole clip. forward
embeds first: `rope` turns the latent's shape into rotary (cos, sin) for every token (buffers
only), `patch_embedding` (a Conv3d) makes the tokens, `condition_embedder` turns the timestep
into `temb` and its six modulations (`proj`) and projects UMT5's tokens: the `embed` block.
Then each `blocks.{i}` maps the tokens with self-attention (rotary), cross-attention to the
text, and a feed-forward: one block each. `norm_out`, modulated by `temb` and the root's
`scale_shift_table` (a parameter outside any submodule: a `TensorPart`), and `proj_out` end
it; unpatchifying is glue in `end`. No skips: the tokens, the text, temb and proj cross every
boundary. Image-to-video (Wan 2.1 I2V) takes CLIP's image tokens beside the text
(`encoder_hidden_states_image`, a per-row input): `embed` projects them and puts them before the
text tokens, where each block's cross-attention splits them off again (the text is 512 tokens).
Wan 2.2 TI2V-5B's image-to-video gives each latent frame its timestep (a [rows, frames]
`timestep`: the first frame's 0, the image's latents pasted there); `embed` expands it to every
token as WanPipeline's `expand_timesteps` does, so the modulations are per token (`token_proj`
[rows, tokens, 6, D], split with the tokens in a sequence group; temb [rows, tokens, D]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
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

UMT5_TOKENS = 512  # WanPipeline's max_sequence_length default
IMAGE_TOKENS = 257  # CLIP ViT-H/14's at 224 px (Wan 2.1 I2V's image encoder): 16 × 16 patches + class
IMAGE = "encoder_hidden_states_image"
NATIVE_LATENT = 60  # 480 px / 8: Wan 2.1's 480p (the planner's square stand-in for 480×832)
NATIVE_FRAMES = 21  # latent frames of 81 video frames (1 + 80 / 4)


class WanTransformerSpec:
    """`diffusers.WanTransformer3DModel`: Wan 2.1 and 2.2 text-to-video."""

    EMBEDDING = ("rope", "patch_embedding", "condition_embedder")
    OUTPUT = ("norm_out", "proj_out", "scale_shift_table")

    def native_latent(self, model: nn.Module) -> int:
        return NATIVE_LATENT

    def layout(self, model: nn.Module) -> Layout:
        return stacked_layout(model, self.EMBEDDING, ("blocks",), self.OUTPUT)

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.in_channels, NATIVE_FRAMES, latent_size, latent_size)
        sample = torch.randn(size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        context = torch.randn(batch, UMT5_TOKENS, config.text_dim, dtype=dtype, device=device)
        image = {}
        if config.image_dim is not None:  # image-to-video
            image[IMAGE] = torch.randn(batch, IMAGE_TOKENS, config.image_dim, dtype=dtype, device=device)
        return DenoiserInputs(sample, timestep, context, image)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, (IMAGE,), "Wan")
        sample, timestep = rows["sample"], rows["timestep"]
        frames = sample.shape[2] // model.config.patch_size[0]
        if timestep.ndim == 2 and timestep.shape[1] != frames:
            raise ValueError(f"the Wan block walk takes a timestep a row or one per latent frame ({frames})")
        return Flow(rows, {"size": tuple(sample.shape[2:]), "rotary": model.rope(sample)})  # no weights

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        calls.update((f"blocks.{i}", BlockCall(b, block)) for i, b in enumerate(model.blocks))
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        hidden, (frames, height, width) = flow.rows["hidden"], flow.shared["size"]
        p_t, p_h, p_w = model.config.patch_size
        f, h, w = frames // p_t, height // p_h, width // p_w
        hidden = hidden.reshape(hidden.shape[0], f, h, w, p_t, p_h, p_w, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        return dit_boundary(model.blocks, "blocks")

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Each block on a slice of the video's tokens; the text is whole on every rank (its
        cross-attention's keys: gathered from every rank, they repeat, which leaves softmax's
        weights as they are: exact, if D times the keys)."""
        blocks = frozenset(f"blocks.{i}" for i in range(len(model.blocks)))
        return SequenceSplit(blocks, {"hidden": 1, "token_proj": 1}, rotary_slice)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """Each block's self- and cross-attention by heads (with Wan 2.1 I2V's image keys), their
        q/k norms over every head's features summed over the ranks, and the feed-forward."""
        cuts = {f"blocks.*.{a}.{p}": Cut.COLUMN for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")}
        cuts |= {f"blocks.*.{a}.to_out.0": Cut.ROW for a in ("attn1", "attn2")}
        cuts |= {f"blocks.*.attn2.{p}": Cut.COLUMN for p in ("add_k_proj", "add_v_proj")}
        cuts |= {f"blocks.*.{a}.{n}": Cut.NORM for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")}
        cuts |= {"blocks.*.attn2.norm_added_k": Cut.NORM}
        cuts |= {"blocks.*.ffn.net.0.proj": Cut.COLUMN, "blocks.*.ffn.net.2": Cut.ROW}
        return TensorSplit(self.sequence(model).blocks, cuts)


def rotary_slice(shared: dict[str, Any], cuts: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The rotary (cos, sin) [1, tokens, 1, d] of a rank's tokens."""
    start, stop, _ = cuts["hidden"]
    return {**shared, "rotary": tuple(x[:, start:stop] for x in shared["rotary"])}


# The blocks' calls: fn(owner, rows, shared) → rows, as WanTransformer3DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden = model.patch_embedding(rows["sample"]).flatten(2).transpose(1, 2).contiguous()
    timestep, seq_len = rows["timestep"], None
    if timestep.ndim == 2:  # a timestep per latent frame → per token, as expand_timesteps flattens them
        timestep = timestep.repeat_interleave(hidden.shape[1] // timestep.shape[1], dim=1)
        timestep, seq_len = timestep.flatten(), timestep.shape[1]
    temb, proj, context, image = model.condition_embedder(
        timestep, rows["context"], rows.get(IMAGE), timestep_seq_len=seq_len
    )
    if image is not None:  # image-to-video: the image's tokens first, as the model's forward puts them
        context = torch.concat([image, context], dim=1)
    if seq_len is not None:
        return {"hidden": hidden, "temb": temb, "token_proj": proj.unflatten(2, (6, -1)), "context": context}
    return {"hidden": hidden, "temb": temb, "proj": proj.unflatten(1, (6, -1)), "context": context}


def block(owner: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    proj = rows["token_proj"] if "token_proj" in rows else rows["proj"]
    hidden = owner(rows["hidden"], rows["context"], proj, shared["rotary"])
    return {**rows, "hidden": hidden}


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden, temb, table = rows["hidden"], rows["temb"], model.scale_shift_table.to(rows["temb"].device)
    if temb.ndim == 3:  # per token: [rows, tokens, D]
        shift, scale = (s.squeeze(2) for s in (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2))
    else:
        shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    return {"hidden": model.proj_out(hidden)}
