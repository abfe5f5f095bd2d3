"""Qwen-Image's transformer (`diffusers.QwenImageTransformer2DModel`) as blocks.

forward embeds first: `img_in` projects the packed latent tokens (2x2 patches of the 16-channel
latent, 64 features each, packed as FLUX.1's), `txt_norm` (RMSNorm) and `txt_in` the text
encoder's tokens, `time_text_embed` turns the timestep into `temb`, and `pos_embed` (no weights)
makes the rotary frequencies of the image positions (centred: `scale_rope`) and of the text
positions after them, once for every block. Those form the `embed` block. Then 60 double-stream
`transformer_blocks` map (image tokens, text tokens) with temb, the text mask and the rotary
frequencies: one block each. `norm_out` (modulated by temb) and `proj_out` end it. No skips.
A ControlNet's `controlnet_block_samples` are added to the image tokens after each block, as
forward adds them (laid out one a block by `begin`, as FLUX.1's).

Prompts differ in length: each row's text tokens come zero-padded to `TEXT_TOKENS` with a mask
(`encoder_hidden_states_mask`, which the attention processor joins to the image's), a call's cut
to the columns its longest row uses, rounded up to `TEXT_BUCKET` (`pipeline/steps/state.py`: the host
knows the lengths; reading them here waited for the GPU every call). Rows of different prompts
share a call, their padding masked out of attention (equal to diffusers' unpadded lone prompt
within 1e-6).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    REFERENCE_SHAPES,
    REFERENCES,
    TEXT_MASK,
    BlockCall,
    CacheBoundary,
    Cut,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    TensorSplit,
    diffusers_split,
    flow_timesteps,
    present,
    stacked_layout,
)
from server.engine.denoisers.dit import carried, controlled, dit_boundary, out, token_rows
from server.engine.denoisers.flux import pack, unpack

TEXT_TOKENS = 512  # QwenImagePipeline's max_sequence_length default: a prompt's tokens past it are cut
CONTROL = {"controlnet_block_samples": "transformer_blocks"}  # a ControlNet's residuals


class QwenImageTransformerSpec:
    """`diffusers.QwenImageTransformer2DModel`: Qwen-Image (and the edit models' transformer)."""

    EMBEDDING = ("img_in", "txt_norm", "txt_in", "time_text_embed", "pos_embed")
    OUTPUT = ("norm_out", "proj_out")

    def native_latent(self, model: nn.Module) -> int:
        return 128  # QwenImagePipeline's default_sample_size: 1024 px

    def layout(self, model: nn.Module) -> Layout:
        return stacked_layout(model, present(model, self.EMBEDDING), ("transformer_blocks",), self.OUTPUT)

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.in_channels // 4, latent_size, latent_size)
        sample = torch.randn(size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        context = torch.randn(batch, TEXT_TOKENS, config.joint_attention_dim, dtype=dtype, device=device)
        mask = torch.ones(batch, TEXT_TOKENS, dtype=dtype, device=device)
        return DenoiserInputs(sample, timestep, context, {TEXT_MASK: mask})

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        config = model.config
        if config.zero_cond_t or config.use_additional_t_cond or config.use_layer3d_rope:
            raise ValueError(
                "the Qwen-Image block walk takes Qwen-Image's transformer (not 2511's or Layered's)"
            )
        rows = token_rows(inputs, (TEXT_MASK, REFERENCES, REFERENCE_SHAPES, *CONTROL), "Qwen-Image")
        if samples := rows.get("controlnet_block_samples"):  # block i takes sample i // ceil(blocks /
            blocks = len(model.transformer_blocks)  # samples), as forward adds them
            rows["controlnet_block_samples"] = tuple(
                samples[i // math.ceil(blocks / len(samples))] for i in range(blocks)
            )
        sample = rows.pop("sample")
        _, _, h, w = sample.shape
        mask = rows.pop(TEXT_MASK, None)  # as bool, kept where every column is used (equal to none)
        rows["text_mask"] = None if mask is None else mask.to(torch.bool)
        # QwenImagePipeline passes t.to(latents.dtype) / 1000; time_proj multiplies by 1000 again
        rows["timestep"] = rows["timestep"].to(sample.dtype) / 1000
        rows["hidden"], shapes = pack(sample), [(1, h // 2, w // 2)]
        if (references := rows.pop(REFERENCES, None)) is not None:  # an edit's images, after the noise
            rows["hidden"] = torch.cat([rows["hidden"], references.to(sample.dtype)], dim=1)
            shapes += [(1, round(a), round(b)) for a, b in rows.pop(REFERENCE_SHAPES)[0].tolist()]
        text = rows["context"].shape[1]
        rotary = model.pos_embed([shapes], max_txt_seq_len=text, device=sample.device)
        return Flow(rows, {"size": (h, w), "rotary": rotary})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        calls.update(
            (f"transformer_blocks.{i}", BlockCall(b, joint)) for i, b in enumerate(model.transformer_blocks)
        )
        calls["out"] = BlockCall(model, out)  # the MMDiT's: norm_out(hidden, temb), proj_out
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        h, w = flow.shared["size"]
        return unpack(flow.rows["hidden"][:, : (h // 2) * (w // 2)], h, w)  # the noise's tokens

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        return dit_boundary(model.transformer_blocks, "transformer_blocks")

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Each block on a slice of the image tokens and of the text tokens (and their mask),
        with the rotary frequencies of the positions the slice holds."""
        blocks = frozenset(f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks)))
        tokens = {"hidden": 1, "context": 1, "text_mask": 1, **dict.fromkeys(CONTROL, 1)}
        return SequenceSplit(blocks, tokens, rotary_slice)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """diffusers' own plan for Qwen-Image (`_tp_plan`: heads and both streams' MLPs), and each
        block's modulation gathered (`img_mod`, `txt_mod`: 6 · dim² each, a third of a block)."""
        blocks = self.sequence(model).blocks
        return diffusers_split(model, blocks, {f"transformer_blocks.*.{m}.1": Cut.GATHERED for m in MODS})


MODS = ("img_mod", "txt_mod")


def rotary_slice(shared: dict[str, Any], cuts: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The rotary frequencies of a rank's image slice and text slice."""
    (i0, i1, _), (t0, t1, _) = cuts["hidden"], cuts["context"]
    image, text = shared["rotary"]
    return {**shared, "rotary": (image[i0:i1], text[t0:t1])}


# The blocks' calls: fn(owner, rows, shared) → rows, as QwenImageTransformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden = model.img_in(rows["hidden"])
    temb = model.time_text_embed(rows["timestep"].to(hidden.dtype), hidden)
    context = model.txt_in(model.txt_norm(rows["context"]))
    out = {"hidden": hidden, "temb": temb, "context": context, "text_mask": rows["text_mask"]}
    return carried(out, rows, CONTROL)


def joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    context, hidden = block(
        hidden_states=rows["hidden"],
        encoder_hidden_states=rows["context"],
        encoder_hidden_states_mask=rows["text_mask"],
        temb=rows["temb"],
        image_rotary_emb=shared["rotary"],
    )
    out = {"hidden": hidden, "temb": rows["temb"], "context": context, "text_mask": rows["text_mask"]}
    return controlled(out, rows, "controlnet_block_samples", CONTROL)
