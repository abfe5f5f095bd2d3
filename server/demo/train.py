"""Train the built-in model from scratch on CPU: `python -m server.demo.train [--quick] [--out DIR]`.

1. VAE: an `AutoencoderKL` (64x64x3 → 16x16x4) on fresh procedural images every step,
   decoding the posterior mean (a deterministic encoder, as SD's VAE nearly is).
2. Latents: a fixed set of images encoded to their posterior means, scaled to unit variance
   (the scale is recorded as the VAE's `scaling_factor`, as Stable Diffusion does).
3. Denoiser: a `UNet2DConditionModel` and a tiny `CLIPTextModel`, trained together with 10%
   caption dropout (for classifier-free guidance), v-prediction on a zero-terminal-SNR
   schedule: with SD's schedule the noisiest training input still carries ~7% of the image,
   mostly its mean color, which sampling from pure noise never has; colors come out washed.
4. Save a standard diffusers `StableDiffusionPipeline` folder (safetensors) and
   `recommended.json` (sampling settings, training figures).

Everything runs under fixed seeds; `--quick` runs a few steps of each phase (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, SHAPES, SIZE, caption, sample_batch
from server.demo.tokenizer import build_tokenizer

DEFAULT_OUT = MODEL_DIR
SCHEDULE = {  # shared by training (DDPM) and sampling (DDIM)
    "num_train_timesteps": 1000,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "timestep_spacing": "trailing",
    "clip_sample": False,
    "steps_offset": 1,  # what StableDiffusionPipeline expects; unused by "trailing" spacing
}
RECOMMENDED = {"num_inference_steps": 25, "guidance_scale": 5.0, "scheduler": "DDIMScheduler", "size": SIZE}


@dataclass
class Budget:
    vae_steps: int = 2400
    vae_batch: int = 32
    latent_images: int = 40_000
    unet_steps: int = 2300
    unet_batch: int = 64
    lr: float = 1e-3
    ema_decay: float = 0.998
    caption_dropout: float = 0.1


QUICK = Budget(vae_steps=20, latent_images=256, unet_steps=20, unet_batch=16)


def build_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=1,
        latent_channels=4,
        # one channel per group would be instance norm, which divides out each feature's
        # scale: the absolute color levels the decoder must reproduce
        norm_num_groups=4,
        sample_size=SIZE,
    )


def build_text_encoder(vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    return CLIPTextModel(config)


def build_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=SIZE // 4,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64, 128),
        layers_per_block=2,
        cross_attention_dim=64,
        # diffusers reads this as the number of heads: 2 keeps heads 16-64 wide, which the CPU
        # attention kernel runs 1.6x faster per training step than 8 heads 4-16 wide
        attention_head_dim=2,
        norm_num_groups=8,  # not 32: one channel per group would normalise away latent color levels
    )


def one_cycle(opt: torch.optim.Optimizer, lr: float, steps: int, warmup: float) -> Any:
    """Warm up over `warmup` of the steps (at least two, so short runs work), then anneal."""
    return torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=max(warmup, 2 / steps))


def descend(loss: torch.Tensor, opt: torch.optim.Optimizer, sched: Any, params: list) -> None:
    """One optimizer step on `loss`, its gradients clipped to norm 1, and the schedule's step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()


def training_parser(doc: str | None, default_out: Path) -> argparse.ArgumentParser:
    """The options an adapter's training script shares: --out, --quick, --seed, --steps."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out, help=f"default {default_out}")
    parser.add_argument("--quick", action="store_true", help="a few steps: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="override the step count")
    return parser


def log(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def train_vae(budget: Budget, g: torch.Generator) -> tuple[AutoencoderKL, dict[str, float]]:
    vae = build_vae().train()
    opt = torch.optim.AdamW(vae.parameters(), lr=budget.lr, weight_decay=0.0)
    sched = one_cycle(opt, budget.lr, budget.vae_steps, warmup=0.05)
    start, loss_avg = time.perf_counter(), 0.0
    for step in range(budget.vae_steps):
        images = sample_batch(budget.vae_batch, g).images
        with torch.autocast("cpu", dtype=torch.bfloat16):  # halves the VAE's step time here
            mean = vae.encode(images).latent_dist.mean
            recon = vae.decode(mean).sample.float()
        # Decode the posterior mean: sampled latents (posterior std ~0.45 against a spread of
        # ~0.9 in a first run) drowned the colors. L1 keeps edges crisp, MSE punishes a wrong
        # color far more than a soft edge, and a tiny L2 keeps the latents bounded.
        loss = F.l1_loss(recon, images) + F.mse_loss(recon, images)
        loss = loss + 1e-6 * mean.float().pow(2).sum(dim=(1, 2, 3)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_avg = 0.98 * loss_avg + 0.02 * loss.item() if step else loss.item()
        if step % 200 == 0 or step == budget.vae_steps - 1:
            log(phase="vae", step=step, loss=round(loss_avg, 5), s=round(time.perf_counter() - start, 1))
    # The encoder is deterministic: pin its log-variance output low so latent_dist.sample()
    # equals mode(), as anyone encoding images (img2img) expects.
    with torch.no_grad():
        vae.quant_conv.weight[vae.config.latent_channels :] = 0
        vae.quant_conv.bias[vae.config.latent_channels :] = -30.0
    return vae.eval(), {"vae_seconds": time.perf_counter() - start, "vae_loss": loss_avg}


@torch.no_grad()
def encode_latents(
    vae: AutoencoderKL, n: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Posterior means of `n` images, scaled to unit std; the caption index of each; the scale."""
    latents, labels = [], []
    names = list(COLORS)
    for start in range(0, n, 256):
        batch = sample_batch(min(256, n - start), g)
        latents.append(vae.encode(batch.images).latent_dist.mode())
        labels += [
            names.index(c) * len(SHAPES) + SHAPES.index(s)
            for c, s in zip(batch.colors, batch.shapes, strict=True)
        ]
    stacked = torch.cat(latents)
    scale = 1.0 / stacked.std().item()
    return stacked * scale, torch.tensor(labels), scale


def train_denoiser(
    latents: torch.Tensor,
    labels: torch.Tensor,
    caption_ids: torch.Tensor,  # (19, 77): the 18 captions, then the empty caption
    text_encoder: CLIPTextModel,
    budget: Budget,
    g: torch.Generator,
) -> tuple[UNet2DConditionModel, CLIPTextModel, dict[str, float]]:
    unet = build_unet().train()
    text_encoder.train()
    ema_unet, ema_text = build_unet().eval(), text_encoder.__class__(text_encoder.config).eval()
    ema_unet.load_state_dict(unet.state_dict())
    ema_text.load_state_dict(text_encoder.state_dict())
    noise_schedule = DDPMScheduler(**SCHEDULE)
    params = [*unet.parameters(), *text_encoder.parameters()]
    opt = torch.optim.AdamW(params, lr=budget.lr, weight_decay=1e-2)
    sched = one_cycle(opt, budget.lr, budget.unet_steps, warmup=0.03)
    empty = caption_ids.shape[0] - 1
    start, loss_avg = time.perf_counter(), 0.0
    for step in range(budget.unet_steps):
        idx = torch.randint(len(latents), (budget.unet_batch,), generator=g)
        x0, label = latents[idx], labels[idx]
        label = torch.where(torch.rand(len(label), generator=g) < budget.caption_dropout, empty, label)
        # 19 distinct captions: encode each once per step, then gather rows (gradients flow through)
        context = text_encoder(caption_ids)[0][label]
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_schedule.config.num_train_timesteps, (len(x0),), generator=g)
        noisy = noise_schedule.add_noise(x0, noise, t)
        target = noise_schedule.get_velocity(x0, noise, t)
        loss = F.mse_loss(unet(noisy, t, encoder_hidden_states=context).sample, target)
        descend(loss, opt, sched, params)
        decay = min(budget.ema_decay, (1 + step) / (10 + step))  # short warm-up of the average
        with torch.no_grad():
            for ema, live in ((ema_unet, unet), (ema_text, text_encoder)):
                torch._foreach_lerp_(list(ema.parameters()), list(live.parameters()), 1 - decay)
        loss_avg = 0.99 * loss_avg + 0.01 * loss.item() if step else loss.item()
        if step % 250 == 0 or step == budget.unet_steps - 1:
            log(phase="unet", step=step, loss=round(loss_avg, 5), s=round(time.perf_counter() - start, 1))
    return ema_unet, ema_text, {"unet_seconds": time.perf_counter() - start, "unet_loss": loss_avg}


def train(out: Path, budget: Budget, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    started = time.perf_counter()

    # 1. VAE
    vae, figures = train_vae(budget, g)

    # 2. Latents
    latents, labels, scale = encode_latents(vae, budget.latent_images, g)
    vae.register_to_config(scaling_factor=scale)
    log(phase="latents", n=len(latents), scaling_factor=round(scale, 5))

    # 3. Text encoder and UNet
    tokenizer = build_tokenizer()
    prompts = [caption(c, s) for c in COLORS for s in SHAPES] + [""]
    caption_ids = tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
    text_encoder = build_text_encoder(
        len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    unet, text_encoder, more = train_denoiser(latents, labels, caption_ids, text_encoder, budget, g)
    figures |= more

    # 4. Save a standard pipeline folder
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(**SCHEDULE),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(out, safe_serialization=True)
    figures["total_seconds"] = time.perf_counter() - started
    summary = {
        "recommended": RECOMMENDED,
        "training": {"seed": seed, "budget": asdict(budget), **{k: round(v, 4) for k, v in figures.items()}},
        "parameters": {
            name: sum(p.numel() for p in module.parameters())
            for name, module in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder))
        },
    }
    (out / "recommended.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(phase="done", **summary["training"], minutes=round(figures["total_seconds"] / 60, 1))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})"
    )
    parser.add_argument("--quick", action="store_true", help="a few steps per phase: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unet-steps", type=int, help="override the denoiser's step count")
    parser.add_argument("--vae-steps", type=int, help="override the VAE's step count")
    args = parser.parse_args(argv)
    budget = QUICK if args.quick else Budget()
    if args.unet_steps is not None:
        budget.unet_steps = args.unet_steps
    if args.vae_steps is not None:
        budget.vae_steps = args.vae_steps
    if min(budget.vae_steps, budget.unet_steps) <= 0:
        parser.error("step counts must be positive")
    train(args.out, budget, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
