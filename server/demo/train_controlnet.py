"""Teach the built-in model to draw its shape where a control image says, as a ControlNet:
`python -m server.demo.train_controlnet`.

The control image is the shape's silhouette: white where the dataset drew the shape, black
elsewhere, at the image's 64x64. The caption still names the color and the shape; the silhouette
says where the shape goes and how large it is, which the base model draws at random.

1. Base: the committed folder (`server/demo/model`), float32, every base weight frozen.
2. Data: dataset images, encoded once to the VAE's scaled posterior means (as `train.py`
   trained on), each with its silhouette (the pixels brighter than the darkest shape color can
   be: the background is at most BACKGROUND_MAX gray).
3. ControlNet: diffusers' `ControlNetModel.from_unet`, its conditioning embedding with three
   widths: two stride-2 convolutions take the 64x64 silhouette to the 16x16 latents (the
   built-in VAE downsamples by 4; the default's three would go to 8x8). Its zero convolutions
   start at zero, as diffusers' train_controlnet.py starts them.
4. Loss: the base's (v-prediction, the zero-terminal-SNR schedule, 10% empty captions), the UNet
   run with the ControlNet's residuals; only the ControlNet learns.
5. Save: `save_pretrained` (safetensors) in `server/demo/controlnets/silhouette`, and the
   figures (command, budget, seconds, losses) in `silhouette.json` beside it.

`--quick` runs a few steps: a smoke test. `make run` serves the result as `silhouette`.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import ControlNetModel, DDPMScheduler, StableDiffusionPipeline

from server.demo import MODEL_DIR
from server.demo.dataset import BACKGROUND_MAX, COLOR_JITTER, COLORS, all_prompts, sample_batch
from server.demo.sampling import load_pipeline
from server.demo.train import SCHEDULE, descend, log, one_cycle, training_parser

CONTROLNETS_DIR = Path(__file__).parent / "controlnets"
DEFAULT_OUT = CONTROLNETS_DIR / "silhouette"
EMBEDDING_CHANNELS = (16, 32, 64)  # two stride-2 steps: 64x64 pixels to 16x16 latents
# a shape pixel's brightest channel is at least the dimmest color's, less its jitter; the
# background's at most BACKGROUND_MAX: the threshold sits halfway, in [-1, 1]
DIMMEST = min(max(rgb) for rgb in COLORS.values()) - COLOR_JITTER
THRESHOLD = (DIMMEST + BACKGROUND_MAX) / 255 - 1


@dataclass
class Budget:
    steps: int = 1200
    batch: int = 32
    lr: float = 1e-3
    latent_images: int = 4096
    caption_dropout: float = 0.1


QUICK = Budget(steps=4, batch=8, latent_images=64)


def silhouettes(images: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] → their shapes' silhouettes, RGB in [0, 1] (as the pipelines feed a
    control image): 1 where a pixel is brighter than any background can be."""
    return (images.amax(dim=1, keepdim=True) > THRESHOLD).float().expand(-1, 3, -1, -1).contiguous()


def encode(
    pipe: StableDiffusionPipeline, n: int, prompts: list[str], g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` dataset images as scaled latents, their silhouettes, and each one's caption index."""
    latents, controls, labels = [], [], []
    with torch.no_grad():
        for start in range(0, n, 256):
            batch = sample_batch(min(256, n - start), g)
            latents.append(pipe.vae.encode(batch.images).latent_dist.mode())
            controls.append(silhouettes(batch.images))
            labels += [prompts.index(c) for c in batch.captions]
    return torch.cat(latents) * pipe.vae.config.scaling_factor, torch.cat(controls), torch.tensor(labels)


def train_controlnet(pipe: StableDiffusionPipeline, budget: Budget, g: torch.Generator) -> tuple[Any, dict]:
    prompts = [text for _, _, text in all_prompts()] + [""]
    empty = len(prompts) - 1
    ids = pipe.tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        contexts = pipe.text_encoder(ids)[0]  # the text encoder is frozen: every caption once

    started = time.perf_counter()
    latents, controls, labels = encode(pipe, budget.latent_images, prompts, g)
    log(phase="latents", n=budget.latent_images, s=round(time.perf_counter() - started, 1))

    for part in (pipe.unet, pipe.vae, pipe.text_encoder):
        part.requires_grad_(False)
    net = ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=EMBEDDING_CHANNELS)
    net.train()
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=budget.lr, weight_decay=1e-2)
    sched = one_cycle(opt, budget.lr, budget.steps, warmup=0.05)
    noise_schedule = DDPMScheduler(**SCHEDULE)
    losses, loss_avg = [], 0.0
    for step in range(budget.steps):
        pick = torch.randint(len(latents), (budget.batch,), generator=g)
        x0, control = latents[pick], controls[pick]
        dropped = torch.rand(budget.batch, generator=g) < budget.caption_dropout
        label = torch.where(dropped, empty, labels[pick])
        context = contexts[label]
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_schedule.config.num_train_timesteps, (budget.batch,), generator=g)
        noisy = noise_schedule.add_noise(x0, noise, t)
        down, mid = net(noisy, t, encoder_hidden_states=context, controlnet_cond=control, return_dict=False)
        predicted = pipe.unet(
            noisy,
            t,
            encoder_hidden_states=context,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample
        loss = F.mse_loss(predicted, noise_schedule.get_velocity(x0, noise, t))
        descend(loss, opt, sched, params)
        loss_avg = 0.98 * loss_avg + 0.02 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == budget.steps - 1:
            losses.append({"step": step, "loss": round(loss_avg, 5)})
            seconds = round(time.perf_counter() - started, 1)
            log(phase="controlnet", step=step, loss=round(loss_avg, 5), s=seconds)
    net.eval()
    return net, {"seconds": round(time.perf_counter() - started, 1), "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = training_parser(__doc__, DEFAULT_OUT)
    args = parser.parse_args(argv)
    budget = QUICK if args.quick else Budget()
    if args.steps is not None:
        budget.steps = args.steps
    if budget.steps <= 0:
        parser.error(f"steps must be positive, got {budget.steps}")

    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    net, training = train_controlnet(load_pipeline(MODEL_DIR), budget, g)
    net.save_pretrained(args.out, safe_serialization=True)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    figures = {
        "command": shlex.join(
            ["python", "-m", "server.demo.train_controlnet", *(sys.argv[1:] if argv is None else argv)]
        ),
        "control": "the shape's silhouette: white where the dataset drew it, black elsewhere, 64x64",
        "base_model": "server/demo/model",
        "seed": args.seed,
        "budget": asdict(budget),
        "conditioning_embedding_out_channels": list(EMBEDDING_CHANNELS),
        "bytes": size,
        "training": training,
    }
    args.out.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    log(phase="done", bytes=size, seconds=training["seconds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
