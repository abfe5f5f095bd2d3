"""Prompts → the UNet's text conditioning, computed the way diffusers' pipelines compute it.

SD 1.x/2.x: the text encoder's last hidden state. SDXL: the penultimate hidden states of
both encoders side by side, plus the second encoder's pooled projection. Many prompts are
encoded in one batched call: every prompt is padded to the tokenizer's full length, and
CLIP's causal attention keeps padding from reaching the tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class TextEmbeddings:
    context: torch.Tensor  # [N, tokens, dim]: the cross-attention context
    pooled: torch.Tensor | None = None  # [N, dim]: SDXL's pooled prompt embedding


class PromptEncoder:
    def __init__(self, kind: str, tokenizers: tuple[Any, ...], encoders: tuple[nn.Module, ...]) -> None:
        if len(tokenizers) != len(encoders):
            raise ValueError(f"{len(tokenizers)} tokenizers for {len(encoders)} text encoders")
        self.kind = kind
        self.tokenizers = tokenizers
        self.encoders = encoders

    @property
    def device(self) -> torch.device:
        return next(self.encoders[0].parameters()).device

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> TextEmbeddings:
        if self.kind == "sdxl":
            return self._encode_sdxl(prompts)
        tokens = self._tokenize(self.tokenizers[0], prompts)
        encoder = self.encoders[0]
        # as diffusers: the attention mask only for encoders configured to use one
        use_mask = getattr(encoder.config, "use_attention_mask", False)
        mask = tokens.attention_mask.to(self.device) if use_mask else None
        return TextEmbeddings(encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0])

    def _encode_sdxl(self, prompts: list[str]) -> TextEmbeddings:
        contexts, pooled = [], None
        for tokenizer, encoder in zip(self.tokenizers, self.encoders, strict=True):
            ids = self._tokenize(tokenizer, prompts).input_ids.to(self.device)
            out = encoder(ids, output_hidden_states=True)
            if pooled is None and out[0].ndim == 2:  # CLIPTextModelWithProjection's text_embeds
                pooled = out[0]
            contexts.append(out.hidden_states[-2])
        return TextEmbeddings(torch.cat(contexts, dim=-1), pooled)

    @staticmethod
    def _tokenize(tokenizer: Any, prompts: list[str]) -> Any:
        return tokenizer(
            prompts,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
