"""LTX-2's audio-video transformer (`diffusers.LTX2VideoTransformer3DModel`) as blocks.

One row denoises a video and its sound together: its sample is [rows, video tokens + audio
tokens, C], the video's packed latents (1×1×1 patches of the 32×-spatial, 8×-temporal VAE's
latents) followed by the audio's (each latent step's channels × mel bins), as the family
(`server/pipeline/families/ltx2.py`) lays them out; one call returns both velocities the same
way. Where each row's tokens sit is in its positions (`VIDEO_COORDS` [rows, 3, video tokens, 2]
and `AUDIO_COORDS` [rows, 1, audio tokens, 2], float32: the pipeline's `prepare_*_coords`), so
their shapes say where the video ends, and rows of different sizes but the same token counts
share a call. Each row's prompt comes as two streams from the text connectors (`context` for the
video, `AUDIO_CONTEXT` for the audio), unmasked: the connectors fill a prompt's padding with their
learnable registers and attend to every token (their mask is all ones).

forward embeds first (`embed`: the rotary embeddings of the positions, the two input
projections, the timestep's modulations of both streams, their cross-attention's and the
prompt's), then each `transformer_blocks.{i}` maps both streams at once: self-attention, the
prompt's cross-attention, audio↔video cross-attention and the MLPs; `out` ends both.

The guidance passes are rows too, so a request's passes and other requests' rows share a call:
per row, `STG` [rows, blocks] is 0 where spatio-temporal guidance replaces a block's
self-attention by its values (the pipeline's `perturbation_mask`), and `ISOLATED` [rows] is 1 on
a modality-isolation row (its audio↔video attention gated to exactly 0: every row runs every
block in one call, so per-row adapters and the compiled blocks see one batch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

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
    present,
    stacked_layout,
)
from server.engine.denoisers.dit import token_rows

VIDEO_COORDS = "video_coords"  # [rows, 3, video tokens, 2]: each patch's (frame, y, x) bounds
AUDIO_COORDS = "audio_coords"  # [rows, 1, audio tokens, 2]: each audio latent's start and end, seconds
AUDIO_CONTEXT = "audio_encoder_hidden_states"  # the audio connector's prompt tokens [rows, T, D_a]
STG = "stg_mask"  # [rows, blocks]: 0 where the block's self-attention is perturbed
ISOLATED = "isolated"  # [rows]: 1 on a modality-isolation row
TAKES = (AUDIO_CONTEXT, VIDEO_COORDS, AUDIO_COORDS, STG, ISOLATED)
NATIVE_LATENT = 16  # 512 px / 32: the planner's square stand-in for the default 768×512
NATIVE_FRAMES = 16  # latent frames of 121 video frames (1 + 120 / 8)
TEXT_TOKENS = 1024  # LTX2Pipeline's max_sequence_length
# The transformer's modules that run before its blocks; those a config leaves out are skipped.
EMBEDDING = (
    "proj_in",
    "audio_proj_in",
    "caption_projection",
    "audio_caption_projection",
    "time_embed",
    "audio_time_embed",
    "prompt_adaln",
    "audio_prompt_adaln",
    "av_cross_attn_video_scale_shift",
    "av_cross_attn_video_a2v_gate",
    "av_cross_attn_audio_scale_shift",
    "av_cross_attn_audio_v2a_gate",
    "keyframes_abs_pos_embedding",
    "rope",
    "audio_rope",
    "cross_attn_rope",
    "cross_attn_audio_rope",
)
OUTPUT = (
    "norm_out",
    "proj_out",
    "scale_shift_table",
    "audio_norm_out",
    "audio_proj_out",
    "audio_scale_shift_table",
)


class LTX2TransformerSpec:
    """`diffusers.LTX2VideoTransformer3DModel`: LTX-2, video and audio from one denoiser."""

    def native_latent(self, model: nn.Module) -> int:
        return NATIVE_LATENT

    def layout(self, model: nn.Module) -> Layout:
        return stacked_layout(model, present(model, EMBEDDING), ("transformer_blocks",), OUTPUT)

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        """A 121-frame clip at `latent_size`² and its 5 s of sound (126 audio latents at 16 kHz)."""
        config = model.config
        video = NATIVE_FRAMES * latent_size * latent_size
        audio = round(
            121 / 24 * config.audio_sampling_rate / config.audio_hop_length / config.audio_scale_factor
        )
        sample = torch.randn(batch, video + audio, config.in_channels, dtype=dtype, device=device)
        text = (batch, TEXT_TOKENS)
        # the connectors' widths: Gemma's, which LTX-2.0 projects inside; else the blocks' own
        raw = config.use_prompt_embeddings
        widths = (
            (config.caption_channels,) * 2
            if raw
            else (config.cross_attention_dim, config.audio_cross_attention_dim)
        )
        conditioning = {
            AUDIO_CONTEXT: torch.randn(*text, widths[1], dtype=dtype, device=device),
            VIDEO_COORDS: model.rope.prepare_video_coords(
                batch, NATIVE_FRAMES, latent_size, latent_size, device
            ),
            AUDIO_COORDS: model.audio_rope.prepare_audio_coords(batch, audio, device),
            STG: torch.ones(batch, len(model.transformer_blocks), dtype=dtype, device=device),
            ISOLATED: torch.zeros(batch, dtype=dtype, device=device),
        }
        context = torch.randn(*text, widths[0], dtype=dtype, device=device)
        return DenoiserInputs(sample, flow_timesteps(batch, device), context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, TAKES, "LTX-2")
        video = rows[VIDEO_COORDS].shape[2]
        rows["video"], rows["audio"] = rows.pop("sample").split([video, rows[AUDIO_COORDS].shape[2]], dim=1)
        index = {id(block): i for i, block in enumerate(model.transformer_blocks)}
        # read once a call (one wait for the device): the blocks some row perturbs, any isolation;
        # a trace (meta or fake tensors: no values) runs the plain passes
        perturbed, isolating = [], False
        if not (rows[STG].is_meta or is_fake(rows[STG])):
            perturbed = (rows[STG] == 0).any(dim=0).nonzero().flatten().tolist()
            isolating = bool(rows[ISOLATED].any())
        return Flow(rows, {"index": index, "perturbed": frozenset(perturbed), "isolating": isolating})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        calls.update(
            (f"transformer_blocks.{i}", BlockCall(b, joint)) for i, b in enumerate(model.transformer_blocks)
        )
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        return torch.cat([flow.rows["video"], flow.rows["audio"]], dim=1)

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        """After the first block, as for the other DiTs: the video's change decides, and a reusing
        row adds what the deep blocks added to both streams when it last ran them."""
        blocks = len(model.transformer_blocks)
        if blocks < 2:
            return None
        deep = ("transformer_blocks.1", f"transformer_blocks.{blocks - 1}")
        after = ("video", "audio", "video_embedded", "audio_embedded")
        first = "transformer_blocks.0"
        return CacheBoundary(deep, "video", "residual", first=first, after=after, more=("audio",))

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Each block on a slice of both streams' tokens, of both prompts', of their rotary
        embeddings ([rows, heads, tokens, d] split, [rows, tokens, d] interleaved) and of the
        video's modulations where they are a token's (image-to-video): every
        attention, self, the prompt's and audio↔video, gathers its keys from the group."""
        blocks = frozenset(f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks)))
        rotary = 2 if model.config.rope_type == "split" else 1
        tokens = {"video": 1, "audio": 1, "context": 1, "audio_context": 1, "temb_tokens": 1}
        tokens |= {f"{k}_rotary": rotary for k in ("video", "audio", "video_cross", "audio_cross")}
        return SequenceSplit(blocks, tokens)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """Each block's six attentions (both streams' self-attention and prompt attention, audio↔
        video both ways) by heads, their per-head gates with them and their q/k norms over every
        head's features summed over the ranks, and both streams' feed-forwards; the modulation
        tables stay whole."""
        blocks = self.sequence(model).blocks
        cuts: dict[str, Cut] = {}
        for attention in ATTENTIONS:
            at = f"transformer_blocks.*.{attention}"
            cuts |= {f"{at}.{p}": Cut.COLUMN for p in ("to_q", "to_k", "to_v", "to_gate_logits")}
            cuts |= {f"{at}.to_out.0": Cut.ROW, f"{at}.norm_q": Cut.NORM, f"{at}.norm_k": Cut.NORM}
        for ff in ("ff", "audio_ff"):
            cuts |= {
                f"transformer_blocks.*.{ff}.net.0.proj": Cut.COLUMN,
                f"transformer_blocks.*.{ff}.net.2": Cut.ROW,
            }
        split_rotary = model.config.rope_type == "split"  # [rows, heads, tokens, d]: a rank's heads
        rotary = (
            {f"{k}_rotary": 1 for k in ("video", "audio", "video_cross", "audio_cross")}
            if split_rotary
            else {}
        )
        return TensorSplit(blocks, cuts, head_rows=rotary)


ATTENTIONS = ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


# The blocks' calls: fn(owner, rows, shared) → rows, as LTX2VideoTransformer3DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    config, video, audio = model.config, rows["video"], rows["audio"]
    batch, dtype, device = video.shape[0], video.dtype, video.device
    video_coords, audio_coords = rows[VIDEO_COORDS], rows[AUDIO_COORDS]
    # the pipeline passes its timestep as the sigma too; a still first frame's (image-to-video)
    # video tokens have their own (0 on the frame), the audio and the sigma the row's
    timestep = sigma = rows["timestep"]
    if timestep.ndim == 2:
        timestep, sigma = timestep[:, : video.shape[1]], timestep[:, -1]
    flow = {
        "video_rotary": model.rope(video_coords, device=device),
        "audio_rotary": model.audio_rope(audio_coords, device=device),
        "video_cross_rotary": model.cross_attn_rope(video_coords[:, 0:1, :], device=device),
        "audio_cross_rotary": model.cross_attn_audio_rope(audio_coords[:, 0:1, :], device=device),
        "video": model.proj_in(video),
        "audio": model.audio_proj_in(audio),
        STG: rows[STG],
        ISOLATED: rows[ISOLATED],
    }
    temb, flow["video_embedded"] = _modulation(model.time_embed, timestep, batch, dtype)
    # a timestep a video token (a still first frame) makes a modulation a token, split with them
    flow["temb"], flow["temb_tokens"] = (None, temb) if timestep.ndim == 2 else (temb, None)
    flow["temb_audio"], flow["audio_embedded"] = _modulation(model.audio_time_embed, sigma, batch, dtype)
    flow["temb_prompt"] = flow["temb_prompt_audio"] = None
    if model.prompt_modulation and config.use_prompt_adaln_single:
        flow["temb_prompt"] = _modulation(model.prompt_adaln, sigma, batch, dtype)[0]
        flow["temb_prompt_audio"] = _modulation(model.audio_prompt_adaln, sigma, batch, dtype)[0]
    # audio↔video attention's modulations take the other stream's sigma (use_cross_timestep)
    gate_scale = config.cross_attn_timestep_scale_multiplier / config.timestep_scale_multiplier
    flow["video_ca"] = _modulation(model.av_cross_attn_video_scale_shift, sigma, batch, dtype)[0]
    flow["video_gate"] = _modulation(model.av_cross_attn_video_a2v_gate, sigma * gate_scale, batch, dtype)[0]
    flow["audio_ca"] = _modulation(model.av_cross_attn_audio_scale_shift, sigma, batch, dtype)[0]
    flow["audio_gate"] = _modulation(model.av_cross_attn_audio_v2a_gate, sigma * gate_scale, batch, dtype)[0]
    context, audio_context = rows["context"], rows[AUDIO_CONTEXT]
    if config.use_prompt_embeddings:  # LTX-2.0 projects the prompt here (2.3: in the connectors)
        context = model.caption_projection(context).view(batch, -1, flow["video"].shape[-1])
        audio_context = model.audio_caption_projection(audio_context).view(batch, -1, flow["audio"].shape[-1])
    flow["context"], flow["audio_context"] = context, audio_context
    return flow


def _modulation(
    embedding: nn.Module, timestep: torch.Tensor, batch: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """An `LTX2AdaLayerNormSingle`'s (modulation, embedded timestep), [rows, 1, D] each."""
    modulation, embedded = embedding(timestep.flatten(), batch_size=batch, hidden_dtype=dtype)
    return modulation.view(batch, -1, modulation.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])


def joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """One block on both streams. A modality-isolation row's audio↔video attention is gated off:
    its gates' timestep modulation is the block's table negated, so table + modulation is exactly
    0 and the row's streams get exactly nothing from it (the pipeline's isolated pass skips it)."""
    video_gate, audio_gate = rows["video_gate"], rows["audio_gate"]
    if shared["isolating"]:
        off = rows[ISOLATED].to(torch.bool)[:, None, None]
        video_gate = _gated_off(off, block.video_a2v_cross_attn_scale_shift_table, video_gate)
        audio_gate = _gated_off(off, block.audio_a2v_cross_attn_scale_shift_table, audio_gate)
    # spatio-temporal guidance: a row's 0 lerps the block's self-attention to its values (a
    # row's 1, to the attention's output: exact to a rounding)
    column = shared["index"][id(block)]
    mask = rows[STG][:, column, None, None] if column in shared["perturbed"] else None
    video, audio = block(
        hidden_states=rows["video"],
        audio_hidden_states=rows["audio"],
        encoder_hidden_states=rows["context"],
        audio_encoder_hidden_states=rows["audio_context"],
        temb=rows["temb"] if rows["temb"] is not None else rows["temb_tokens"],
        temb_audio=rows["temb_audio"],
        temb_ca_scale_shift=rows["video_ca"],
        temb_ca_audio_scale_shift=rows["audio_ca"],
        temb_ca_gate=video_gate,
        temb_ca_audio_gate=audio_gate,
        temb_prompt=rows["temb_prompt"],
        temb_prompt_audio=rows["temb_prompt_audio"],
        video_rotary_emb=rows["video_rotary"],
        audio_rotary_emb=rows["audio_rotary"],
        ca_video_rotary_emb=rows["video_cross_rotary"],
        ca_audio_rotary_emb=rows["audio_cross_rotary"],
        encoder_attention_mask=None,  # the connectors' mask is all ones (registers fill the padding)
        audio_encoder_attention_mask=None,
        perturbation_mask=mask,
        all_perturbed=False,
    )
    return {**rows, "video": video, "audio": audio}


def _gated_off(off: torch.Tensor, table: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`gate` [rows, 1, D] with the rows `off` says replaced by minus the block's gate row (the
    table's last): the block adds them to exactly 0."""
    return torch.where(off, -table[4:].to(gate)[None], gate)


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    video = _head(
        model.norm_out, model.proj_out, model.scale_shift_table, rows["video"], rows["video_embedded"]
    )
    audio = _head(
        model.audio_norm_out,
        model.audio_proj_out,
        model.audio_scale_shift_table,
        rows["audio"],
        rows["audio_embedded"],
    )
    return {"video": video, "audio": audio}


def _head(
    norm: nn.Module, proj: nn.Module, table: torch.Tensor, hidden: torch.Tensor, embedded: torch.Tensor
) -> torch.Tensor:
    shift, scale = (table[None, None] + embedded[:, :, None]).unbind(dim=2)
    return proj(norm(hidden) * (1 + scale) + shift)
