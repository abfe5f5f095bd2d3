"""FLUX.3's transformer (`diffusers.Flux3Transformer2DModel`, the base model and the step-distilled
flow map) as blocks.

Three token modes: the noise's image tokens, an edit's reference tokens (`REFERENCES`) and the
prompt's. The latents come patchified (128 features a token, as FLUX.2's) and are packed by
flattening. `embed` makes the modulations once a call: the image tokens' from the timestep, the
prompt's and the references' from timestep 0 (a flow map adds the embedding of the timestep the
step jumps to, `TARGET_TIMESTEP`, to both); each mode's modulation is the same for every token of
it, so it is kept [rows, 1, 3·dim] and broadcast, where diffusers expands it per token first.
Then each mode's own blocks (`txt_mode_blocks`, `mode_blocks.image`, `mode_blocks.image_cond`:
each attends within its mode only), the joint `single_transformer_blocks` over [prompt, image,
references], and the output layers on the image tokens alone.

Position ids are 4-axis (t, h, w, l): a prompt token l at (0, 0, 0, l); an image token at
(0, h/2, w/2, 0) (the pipeline's image RoPE scale, 0.5); reference k's at l = -k.

A prompt is padded to a multiple of 80 tokens and its padding is attended: the transformer takes
no mask. Where a request's rows have prompts of different lengths (a long prompt beside the
empty negative one), the shorter is padded further with keys masked out (`TEXT_MASK`: 1 on the
tokens the pipeline attends), which leaves every row as the pipeline computes it alone; the
blocks then run with that mask (`_mode_block`, `_single_block`, the blocks' own computation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.engine.denoisers.blocks import (
    REFERENCE_IDS,
    REFERENCES,
    TARGET_TIMESTEP,
    TEXT_MASK,
    Block,
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
)
from server.engine.denoisers.dit import token_rows

TEXT_TOKENS = 80  # a prompt's tokens come in multiples of this (Flux3TextEncoderStep's pad_multiple)
IMAGE_ROPE_SCALE = 0.5  # Flux3PrepareLatentsStep's image_rope_scale: image positions at half steps
MODES = ("txt_mode_blocks", "mode_blocks.image", "mode_blocks.image_cond")
TOKENS = {"hidden": 1, "context": 1, "cond": 1, TEXT_MASK: 1}  # each mode's tokens, and the prompt's mask


def image_ids(h: int, w: int, device: torch.device, mode: int = 0) -> torch.Tensor:
    """[h · w, 4] position ids (0, row / 2, column / 2, mode): `_prepare_image_ids` (mode 0 for
    the noise, -k for reference k), made on `device`."""
    rows, columns = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    ids = torch.stack([torch.zeros_like(rows), rows, columns, torch.full_like(rows, mode)], dim=-1)
    ids = ids.reshape(-1, 4).float()
    ids[:, 1:3] *= IMAGE_ROPE_SCALE
    return ids


def text_ids(tokens: int, device: torch.device) -> torch.Tensor:
    """[tokens, 4] position ids (0, 0, 0, l): Flux3TextRoPEInputsStep._prepare_text_ids."""
    ids = torch.zeros(tokens, 4, device=device)
    ids[:, 3] = torch.arange(tokens, device=device)
    return ids


class Flux3TransformerSpec:
    """`diffusers.Flux3Transformer2DModel`: FLUX.3 and FLUX.3 distilled (`flow_map`) alike."""

    EMBEDDING = (
        "pos_embed",
        "time_proj",
        "timestep_embedder",
        "target_timestep_embedder",
        "early_stream_modulations",
        "single_stream_modulations",
        "x_embedders",
        "context_embedder",
    )
    OUTPUT = ("norm_out", "proj_out")

    def native_latent(self, model: nn.Module) -> int:
        return 64  # the pipeline's 1024 px: 64 tokens a side (16 px a token)

    def layout(self, model: nn.Module) -> Layout:
        """The embedding, each mode's blocks in the order forward runs them (prompt, image,
        references), the joint blocks, the output layers."""
        blocks = [Block("embed", present(model, self.EMBEDDING))]
        for stream in (*MODES, "single_transformer_blocks"):
            blocks += [Block(f"{stream}.{i}", (f"{stream}.{i}",)) for i in range(len(_stream(model, stream)))]
        blocks.append(Block("out", self.OUTPUT))
        return Layout(tuple(blocks))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        sample = torch.randn(batch, config.in_channels, latent_size, latent_size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        context = torch.randn(batch, TEXT_TOKENS, config.joint_attention_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {}
        if config.flow_map:
            conditioning[TARGET_TIMESTEP] = timestep * 0.5
        return DenoiserInputs(sample, timestep, context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, (TARGET_TIMESTEP, TEXT_MASK, REFERENCES, REFERENCE_IDS), "FLUX.3")
        sample = rows.pop("sample")
        h, w = sample.shape[-2:]
        device = sample.device
        # Flux3PrepareLatentsStep's packing, contiguous: compiled graphs take a padded call's strides
        rows["hidden"] = sample.flatten(2).transpose(1, 2).contiguous()
        # the pipeline passes (t / 1000).to(latents.dtype); forward multiplies by 1000 again
        for key in ("timestep", TARGET_TIMESTEP):
            if key in rows:
                rows[key] = rows[key].to(sample.dtype) / 1000
        rotary = {
            "text": model.pos_embed(text_ids(inputs.context.shape[1], device)),
            "image": model.pos_embed(image_ids(h, w, device)),
        }
        references = rows.pop(REFERENCES, None)
        if references is not None:  # an edit's images: a mode of their own (the rows share their layout)
            rows["cond"] = references.to(sample.dtype)
            rotary["cond"] = model.pos_embed(rows.pop(REFERENCE_IDS)[0].float())
        mask = rows.pop(TEXT_MASK, None)
        if mask is not None:
            rows[TEXT_MASK] = mask.to(torch.bool)
        return Flow(rows, {"size": (h, w), "rotary": joined(rotary)})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        for stream, fn, needs in zip(
            MODES, (text_mode, image_mode, reference_mode), (None, None, "cond"), strict=True
        ):
            calls.update(
                (f"{stream}.{i}", BlockCall(b, fn, needs)) for i, b in enumerate(_stream(model, stream))
            )
        singles = enumerate(model.single_transformer_blocks)
        calls.update((f"single_transformer_blocks.{i}", BlockCall(b, single)) for i, b in singles)
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        (h, w), hidden = flow.shared["size"], flow.rows["hidden"]
        return hidden.transpose(1, 2).reshape(hidden.shape[0], -1, h, w)

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        """First-Block-Cache on the image tokens: the first image block measures the change; the
        later image blocks, the references' and the joint blocks are the deep part. The prompt's
        blocks run before, every step (the prompt's alone: cheap beside the image's)."""
        if len(model.mode_blocks["image"]) < 2 or not len(model.single_transformer_blocks):
            return None
        last = f"single_transformer_blocks.{len(model.single_transformer_blocks) - 1}"
        return CacheBoundary(
            ("mode_blocks.image.1", last),
            "hidden",
            "residual",
            first="mode_blocks.image.0",
            after=("hidden", "temb"),
        )

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Every mode's blocks and the joint blocks on a slice of each mode's tokens, with the
        rotary embeddings of the positions the slice holds; the prompt's mask cut as its tokens."""
        blocks = frozenset(
            f"{stream}.{i}"
            for stream in (*MODES, "single_transformer_blocks")
            for i in range(len(_stream(model, stream)))
        )
        return SequenceSplit(blocks, TOKENS, rotary_slice)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """Every block's attention by heads (its q/k norms are per head) and its SwiGLU feed-forward
        by halves; the modulations are computed once, outside the blocks (`embed`)."""
        sequence = self.sequence(model).blocks
        cuts: dict[str, Cut] = {}
        for stream in (*MODES, "single_transformer_blocks"):
            cuts |= {f"{stream}.*.attn.{p}": Cut.COLUMN for p in ("to_q", "to_k", "to_v")}
            cuts |= {f"{stream}.*.attn.to_out.0": Cut.ROW, f"{stream}.*.ff.linear_out": Cut.ROW}
            cuts[f"{stream}.*.ff.linear_in"] = Cut.PACKED_COLUMN
        packed = {f"{stream}.*.ff.linear_in": (1, 1) for stream in (*MODES, "single_transformer_blocks")}
        return TensorSplit(sequence, cuts, packed)


def _stream(model: nn.Module, stream: str) -> nn.ModuleList:
    return model.get_submodule(stream)


def joined(rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Each mode's rotary (cos, sin) and the joint blocks' [prompt, image, references] one."""
    modes = [rotary[k] for k in ("text", "image", "cond") if k in rotary]
    return {**rotary, "joint": tuple(torch.cat(parts) for parts in zip(*modes, strict=True))}


def rotary_slice(shared: dict[str, Any], cuts: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The rotary embeddings of a rank's slice of each mode's tokens."""
    keys = {"text": "context", "image": "hidden", "cond": "cond"}
    rotary = {
        mode: tuple(x[cuts[keys[mode]][0] : cuts[keys[mode]][1]] for x in pair)
        for mode, pair in shared["rotary"].items()
        if mode != "joint"
    }
    return {**shared, "rotary": joined(rotary)}


# The blocks' calls: fn(owner, rows, shared) → rows, as Flux3Transformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden = rows["hidden"]
    dtype, n = hidden.dtype, hidden.shape[0]
    image_temb = model.timestep_embedder(model.time_proj(rows["timestep"].to(dtype) * 1000).to(dtype))[
        :, None
    ]
    zero = model.time_proj(torch.zeros(n, device=hidden.device, dtype=dtype))
    zero_temb = model.timestep_embedder(zero.to(dtype))[:, None]
    target = rows.get(TARGET_TIMESTEP)
    if target is not None:  # a flow map: where the step jumps to, on every mode's embedding
        target_temb = model.target_timestep_embedder(model.time_proj(target.to(dtype) * 1000).to(dtype))[
            :, None
        ]
        image_temb, zero_temb = image_temb + target_temb, zero_temb + target_temb
    zero_act, image_act = F.silu(zero_temb), F.silu(image_temb)
    early, single_ = model.early_stream_modulations, model.single_stream_modulations
    out = {
        "hidden": model.x_embedders["image"](hidden),
        "context": model.context_embedder(rows["context"]),
        "temb": image_temb,
        # (prompt early, prompt joint, image early, image joint): [rows, 1, 3·dim] each
        "mods": (
            early["txt"](zero_act),
            single_["txt"](zero_act),
            early["image"](image_act),
            single_["image"](image_act),
        ),
    }
    if "cond" in rows:
        out["cond"] = model.x_embedders["image_cond"](rows["cond"])
        out["cond_mods"] = (early["image_cond"](zero_act), single_["image_cond"](zero_act))
    if TEXT_MASK in rows:
        out[TEXT_MASK] = rows[TEXT_MASK]
    return out


def text_mode(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """A prompt block: its tokens, attending among themselves (a masked row's padding left out)."""
    mask = rows.get(TEXT_MASK)
    return _mode(block, rows, shared, "context", 0, None if mask is None else mask[:, None, None, :])


def image_mode(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return _mode(block, rows, shared, "hidden", 2)


def reference_mode(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """A references' block; rows without references pass through."""
    return _mode(block, rows, shared, "cond", 0) if "cond" in rows else rows


def _mode(
    block: nn.Module, rows: dict[str, Any], shared: dict[str, Any], key: str, mod: int, mask: Any = None
) -> dict[str, Any]:
    """A per-mode block on the rows' `key` tokens with their early modulation (`mods[mod]`, the
    references' `cond_mods[mod]`) and their mode's rotary embeddings."""
    modulation = rows["cond_mods" if key == "cond" else "mods"][mod]
    rotary = shared["rotary"][{"context": "text", "hidden": "image", "cond": "cond"}[key]]
    if mask is None:
        return {**rows, key: block(rows[key], modulation, rotary)}
    return {**rows, key: _mode_block(block, rows[key], modulation, rotary, mask)}


def single(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """A joint block over [prompt, image, references]: the image and reference tokens side by side
    with their modulations, split again after."""
    hidden, context = rows["hidden"], rows["context"]
    image_mod, mods = rows["mods"][3], rows["mods"]
    content, content_mod = hidden, image_mod
    if "cond" in rows:
        cond, cond_mod = rows["cond"], rows["cond_mods"][1]
        content = torch.cat([hidden, cond], dim=1)
        content_mod = torch.cat(
            [image_mod.expand(-1, hidden.shape[1], -1), cond_mod.expand(-1, cond.shape[1], -1)], dim=1
        )
    rotary, mask = shared["rotary"]["joint"], rows.get(TEXT_MASK)
    if mask is None:
        context, content = block(
            hidden_states=content,
            encoder_hidden_states=context,
            temb_mod=content_mod,
            temb_mod_context=mods[1],
            image_rotary_emb=rotary,
        )
    else:
        keys = torch.cat([mask, mask.new_ones(mask.shape[0], content.shape[1])], dim=1)
        context, content = _single_block(
            block, content, context, content_mod, mods[1], rotary, keys[:, None, None]
        )
    out = {**rows, "hidden": content[:, : hidden.shape[1]], "context": context}
    if "cond" in rows:
        out["cond"] = content[:, hidden.shape[1] :]
    return out


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {"hidden": model.proj_out(model.norm_out(rows["hidden"], rows["temb"]))}


# Flux3ModeTransformerBlock.forward and Flux3SingleTransformerBlock.forward with an attention mask
# (theirs pass none): the same computation, their modules.


def _mode_block(
    block: nn.Module, hidden: torch.Tensor, mod: torch.Tensor, rotary: Any, mask: torch.Tensor
) -> torch.Tensor:
    shift, scale, gate = torch.chunk(mod, 3, dim=-1)
    norm = (1 + scale) * block.norm(hidden) + shift
    attention = block.attn(hidden_states=norm, attention_mask=mask, image_rotary_emb=rotary)
    return hidden + gate * (attention + block.ff(norm))


def _single_block(
    block: nn.Module,
    hidden: torch.Tensor,
    context: torch.Tensor,
    mod: torch.Tensor,
    context_mod: torch.Tensor,
    rotary: Any,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    shift, scale, gate = torch.chunk(mod, 3, dim=-1)
    c_shift, c_scale, c_gate = torch.chunk(context_mod, 3, dim=-1)
    norm = (1 + scale) * block.norm(hidden) + shift
    norm_context = (1 + c_scale) * block.norm(context) + c_shift
    combined = torch.cat([norm_context, norm], dim=1)
    output = block.attn(hidden_states=combined, attention_mask=mask, image_rotary_emb=rotary) + block.ff(
        combined
    )
    context_out, hidden_out = torch.split(output, [context.shape[1], hidden.shape[1]], dim=1)
    return context + c_gate * context_out, hidden + gate * hidden_out
