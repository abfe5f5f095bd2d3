"""Teach the built-in model a shape it never saw, as a LoRA: `python -m server.demo.train_lora`.

The shape is `dataset.NEW_SHAPES`' "diamond" (a square turned 45°), in the dataset's six colors.
The built-in model, its tokenizer and its vocabulary stay as they are: "diamond" is no word of
that vocabulary, but every lowercase letter is, so "a red diamond" tokenizes as
`a</w> red</w> d i a m o n d</w>`. Those letter tokens were never in a training caption (their
embeddings are as initialised, shrunk by weight decay), so the adapter has to give them a
meaning: a LoRA on the text encoder's layers (attention q, k, v, out; MLP fc1, fc2) learns to turn
that letter sequence into a "diamond" context, and a LoRA on the UNet's transformer blocks
(attention to_q, to_k, to_v, to_out.0, self and cross; feed-forward; proj_in, proj_out) learns to
draw it. No new token, no shipped embedding: the file is a plain LoRA, ~0.8 MB at rank 8.

1. Base: the committed folder (`server/demo/model`), float32, every base weight frozen.
2. Latents: dataset images of diamonds and, mixed in, of the three base shapes (so the adapter
   keeps colors and the other shapes when asked for; it is applied only to requests that ask),
   encoded once to the VAE's scaled posterior means, as `train.py` trained on.
3. LoRA: peft's `LoraConfig` added to the UNet and the text encoder the diffusers way
   (`add_adapter`), trained as the base was (v-prediction, zero-terminal-SNR schedule, 10%
   empty captions for classifier-free guidance), under fixed seeds.
4. Save: `get_peft_model_state_dict` of each, through `StableDiffusionPipeline.save_lora_weights`:
   safetensors with keys `unet.<module>.lora_A.weight`, `text_encoder.<module>.lora_B.weight`, ...
   and diffusers' `lora_adapter_metadata` (each part's peft config); lora_alpha = rank, so a reader
   that takes alpha = rank when it finds no plain `lora_alpha` reads the same scaling.
5. Figures: the command, budget, seconds and losses, in `diamond.json` beside the adapter.

Then judge it as the server serves it: `python -m benchmarks.quality.diamond_lora` (the serving pipeline
is a layer above this package, which may not import it) adds its evaluation to that JSON.
`--quick` runs a few steps: a smoke test.
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
from diffusers import DDPMScheduler, StableDiffusionPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, SHAPES, caption, sample_batch
from server.demo.sampling import load_pipeline
from server.demo.train import SCHEDULE, descend, log, one_cycle, training_parser

SHAPE = "diamond"
ADAPTERS_DIR = Path(__file__).parent / "adapters"
DEFAULT_OUT = ADAPTERS_DIR / f"{SHAPE}.safetensors"
# diffusers' train_text_to_image_lora.py targets attention (to_q, to_k, to_v, to_out.0 and the
# text encoder's q, k, v, out projections); the feed-forward and projection layers beside it
# were added after a first run: 23/24 → 23/24 on seeds 0-3, 44/48 → 47/48 on seeds 0-7
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


@dataclass
class Budget:
    steps: int = 600
    batch: int = 32
    rank: int = 8
    lr: float = 2e-3
    new_fraction: float = 0.5  # of each batch: diamonds; the rest, base shapes
    latent_images: int = 4096  # per kind (diamonds, base shapes)
    caption_dropout: float = 0.1


QUICK = Budget(steps=4, batch=8, latent_images=64)
MAX_SECONDS, MAX_BYTES = 20 * 60, 2 * 2**20  # trained on a CPU in ≤ 20 minutes, ≤ 2 MB


def encode_latents(
    pipe: StableDiffusionPipeline, n: int, shapes: tuple[str, ...], prompts: list[str], g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` dataset images of `shapes` as scaled posterior means (b, 4, 16, 16), and each one's
    index into `prompts`."""
    latents, labels = [], []
    with torch.no_grad():
        for start in range(0, n, 256):
            batch = sample_batch(min(256, n - start), g, shapes=shapes)
            latents.append(pipe.vae.encode(batch.images).latent_dist.mode())
            labels += [prompts.index(c) for c in batch.captions]
    return torch.cat(latents) * pipe.vae.config.scaling_factor, torch.tensor(labels)


def add_lora(pipe: StableDiffusionPipeline, rank: int) -> list[torch.nn.Parameter]:
    """peft LoRA layers on the UNet's and the text encoder's targets; their parameters."""
    pipe.unet.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    pipe.vae.requires_grad_(False)
    for model, targets in ((pipe.unet, UNET_TARGETS), (pipe.text_encoder, TEXT_TARGETS)):
        model.add_adapter(
            LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets)
        )
    return [p for m in (pipe.unet, pipe.text_encoder) for p in m.parameters() if p.requires_grad]


def train_lora(pipe: StableDiffusionPipeline, budget: Budget, g: torch.Generator) -> dict[str, Any]:
    # 1. Captions: the six new ones, the 18 base ones, then the empty caption
    new = [caption(c, SHAPE) for c in COLORS]
    base = [caption(c, s) for c in COLORS for s in SHAPES]
    prompts = [*new, *base, ""]
    ids = pipe.tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
    empty = len(prompts) - 1

    # 2. Latents
    started = time.perf_counter()
    new_latents, new_labels = encode_latents(pipe, budget.latent_images, (SHAPE,), prompts, g)
    base_latents, base_labels = encode_latents(pipe, budget.latent_images, SHAPES, prompts, g)
    log(phase="latents", n=2 * budget.latent_images, s=round(time.perf_counter() - started, 1))

    # 3. LoRA layers and the loop
    params = add_lora(pipe, budget.rank)
    pipe.unet.train()
    pipe.text_encoder.train()
    opt = torch.optim.AdamW(params, lr=budget.lr, weight_decay=1e-2)
    sched = one_cycle(opt, budget.lr, budget.steps, warmup=0.05)
    noise_schedule = DDPMScheduler(**SCHEDULE)
    n_new = round(budget.batch * budget.new_fraction)
    losses, loss_avg = [], 0.0
    for step in range(budget.steps):
        i_new = torch.randint(len(new_latents), (n_new,), generator=g)
        i_base = torch.randint(len(base_latents), (budget.batch - n_new,), generator=g)
        x0 = torch.cat([new_latents[i_new], base_latents[i_base]])  # (b, 4, 16, 16)
        label = torch.cat([new_labels[i_new], base_labels[i_base]])
        label = torch.where(torch.rand(len(label), generator=g) < budget.caption_dropout, empty, label)
        context = pipe.text_encoder(ids)[0][label]  # (b, 77, 64): 25 captions encoded, rows gathered
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_schedule.config.num_train_timesteps, (len(x0),), generator=g)
        noisy = noise_schedule.add_noise(x0, noise, t)
        target = noise_schedule.get_velocity(x0, noise, t)
        loss = F.mse_loss(pipe.unet(noisy, t, encoder_hidden_states=context).sample, target)
        descend(loss, opt, sched, params)
        loss_avg = 0.98 * loss_avg + 0.02 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == budget.steps - 1:
            losses.append({"step": step, "loss": round(loss_avg, 5)})
            log(phase="lora", step=step, loss=round(loss_avg, 5), s=round(time.perf_counter() - started, 1))
    pipe.unet.eval()
    pipe.text_encoder.eval()
    return {"seconds": round(time.perf_counter() - started, 1), "losses": losses}


def save_adapter(pipe: StableDiffusionPipeline, out: Path) -> int:
    """The LoRA layers in diffusers/PEFT keys (`unet.…lora_A.weight`, `text_encoder.…`); bytes."""
    # peft keeps target_modules as a set: sorted, so the file's header does not vary run to run
    unet_config, text_config = (
        model.peft_config["default"].to_dict() for model in (pipe.unet, pipe.text_encoder)
    )
    for config in (unet_config, text_config):
        config["target_modules"] = sorted(config["target_modules"])
    out.parent.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        out.parent,
        unet_lora_layers=get_peft_model_state_dict(pipe.unet),
        text_encoder_lora_layers=get_peft_model_state_dict(pipe.text_encoder),
        weight_name=out.name,
        unet_lora_adapter_metadata=unet_config,
        text_encoder_lora_adapter_metadata=text_config,
    )
    return out.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = training_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--rank", type=int, help="override the LoRA rank (at most 8)")
    parser.add_argument("--lr", type=float, help="override the peak learning rate")
    args = parser.parse_args(argv)
    budget = QUICK if args.quick else Budget()
    for name in ("steps", "rank", "lr"):
        if getattr(args, name) is not None:
            setattr(budget, name, getattr(args, name))
    if budget.steps <= 0 or not 1 <= budget.rank <= 8:
        parser.error(f"steps must be positive and rank 1..8, got {budget.steps} and {budget.rank}")

    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    pipe = load_pipeline(MODEL_DIR)
    training = train_lora(pipe, budget, g)
    size = save_adapter(pipe, args.out)
    figures = {
        "command": shlex.join(
            ["python", "-m", "server.demo.train_lora", *(sys.argv[1:] if argv is None else argv)]
        ),
        "shape": SHAPE,
        "new_word": (
            "'diamond' is not in the built-in vocabulary: it tokenizes into letter tokens "
            "(d i a m o n d</w>) that a text-encoder LoRA (attention and MLP) plus a UNet LoRA "
            "(attention, feed-forward, proj_in/out) learn to read; no new token, no shipped embedding"
        ),
        "base_model": "server/demo/model",
        "seed": args.seed,
        "budget": asdict(budget),
        "lora_targets": {"unet": UNET_TARGETS, "text_encoder": TEXT_TARGETS},
        "lora_alpha": budget.rank,
        "bytes": size,
        "training": training,
        "within_budget": training["seconds"] <= MAX_SECONDS and size <= MAX_BYTES,
    }
    args.out.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    log(phase="done", bytes=size, seconds=training["seconds"], within_budget=figures["within_budget"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
