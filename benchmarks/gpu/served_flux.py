"""The GPU check's served FLUX.1-dev: one request at 1024x1024, 28 steps, through real uvicorn on
loopback, with random weights made on the device (never on the CPU, never written to disk), timed
end to end and by stage: text encoding, denoising and VAE decoding, as the server counts them
(/v1/stats' `call_seconds_total`, /metrics' `diffshard_pipeline_call_seconds_total`).
`--quick` (the CPU dry run): the same path with the tests' tiny FLUX folder's configs, 64x64, 3 steps.

The server reads a folder of configs, the scheduler's, and the tests' tiny tokenizers (their ids lie
within both encoders' vocabularies; CLIP still runs its 77 positions, T5 its 512). Each weighted
part holds one safetensors file with no tensors in it: every reader of the folder (the settings,
the plan, the app) checks that a part has one. The parts are built here, each on the device from
its config (`build_on_device`), and handed to the app (`create_app(components=...)`), so the
server runs in this process, uvicorn on a thread.

    python -m benchmarks.gpu.served_flux --device cuda --lines FILE
"""

from __future__ import annotations

import base64
import gc
import io
import json
import logging
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import diffusers
import httpx
import torch
import uvicorn
from diffusers import AutoencoderKL, FluxTransformer2DModel
from PIL import Image
from safetensors.torch import save_file
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from benchmarks.gpu import Lines, phase_parser
from benchmarks.gpu.shapes import SHAPES, build_on_device
from server.app import create_app
from server.pipeline.families.flux import CLIP_L, FLUX1, FLUX_VAE, T5_XXL_ENCODER
from server.pipeline.loading.folder import Components, class_of, read_family
from server.settings import Settings
from tests.support.live import free_port
from tests.support.tiny_pipelines import (
    FLUX_DEV_SCHEDULE,
    FLUX_LATENT_CHANNELS,
    _flow_vae,
    _flux_transformer,
    _t5,
    _text_config,
    build_t5_tokenizer,
    build_tokenizer,
)

REQUEST = {"prompt": "a red circle", "size": "1024x1024", "num_inference_steps": 28, "n": 1, "seed": 1}
QUICK_REQUEST = REQUEST | {"size": "64x64", "num_inference_steps": 3}
READY_DEADLINE_S = {"cuda": 600.0, "cpu": 120.0}  # parts built, planned, placed: minutes at most
INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5Tokenizer"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
# each weighted part: how it is made from its config
MAKERS: dict[str, Callable[..., nn.Module]] = {
    "transformer": FluxTransformer2DModel,
    "vae": AutoencoderKL,
    "text_encoder": lambda **config: _without_position_ids(CLIPTextModel(CLIPTextConfig(**config))),
    "text_encoder_2": lambda **config: T5EncoderModel(T5Config(**config)),
}
# black-forest-labs/FLUX.1-dev's configs (server/pipeline/families/flux.py)
PUBLISHED = {
    "transformer": {**FLUX1, "guidance_embeds": True},
    "vae": FLUX_VAE,
    "text_encoder": CLIP_L,
    "text_encoder_2": T5_XXL_ENCODER,
}


def tiny_configs() -> dict[str, dict[str, Any]]:
    """The configs of the tests' tiny FLUX.1-dev folder (`build_flux_folder`), its parts made on
    `meta` (nothing allocated, nothing written)."""
    with torch.device("meta"):
        transformer = _flux_transformer(guidance=True)
        factors = {name: FLUX_VAE[name] for name in ("scaling_factor", "shift_factor")}  # as the folder's
        vae = _flow_vae(FLUX_LATENT_CHANNELS, **factors)
        t5 = _t5(build_t5_tokenizer())
    return {
        "transformer": _public(transformer.config),
        "vae": _public(vae.config),
        "text_encoder": _text_config(build_tokenizer()).to_diff_dict(),
        "text_encoder_2": t5.config.to_diff_dict(),
    }


def _public(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if not key.startswith("_")}


def write_folder(folder: Path, configs: dict[str, dict[str, Any]]) -> Path:
    """A FLUX.1 pipeline folder without weights: the index, the scheduler, the tiny tokenizers, each
    part's config and a safetensors file holding no tensor (marked as such in its metadata)."""
    folder.mkdir(parents=True)
    index = INDEX | {"_diffusers_version": diffusers.__version__}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    diffusers.FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULE).save_pretrained(folder / "scheduler")
    build_tokenizer().save_pretrained(folder / "tokenizer")
    build_t5_tokenizer().save_pretrained(folder / "tokenizer_2")
    for part, config in configs.items():
        (folder / part).mkdir()
        (folder / part / "config.json").write_text(json.dumps(config | {"_class_name": INDEX[part][1]}))
        note = {"diffshard": "no weights: the GPU check builds this part on the device"}
        save_file({}, folder / part / "no-weights.safetensors", metadata=note)
    return folder


def build_components(
    folder: Path, configs: dict[str, dict[str, Any]], dtype: torch.dtype, device: torch.device
) -> Components:
    """Every weighted part made on `device` from its config (`build_on_device`: weights N(0, 0.02),
    norms 1, biases 0); the tokenizers and scheduler read from the folder as the loader reads them."""
    family = read_family(folder)
    index = family.config.index

    def built(part: str) -> nn.Module:
        shape = replace(SHAPES["flux"], cls=MAKERS[part], config=configs[part], what=part)
        model = build_on_device(shape, dtype, device)
        if part == "text_encoder":  # CLIP's position ids, made on the device as its constructor does
            ids = torch.arange(model.config.max_position_embeddings, device=device).expand((1, -1))
            _embeddings(model).register_buffer("position_ids", ids, persistent=False)
        return model

    def read(part: str) -> Any:
        return class_of(index, part).from_pretrained(folder / part, local_files_only=True)

    return Components(
        family=family,
        folder=folder,
        denoiser=built("transformer"),
        vae=built("vae"),
        text_encoders=(built("text_encoder"), built("text_encoder_2")),
        tokenizers=(read("tokenizer"), read("tokenizer_2")),
        scheduler=family.pipeline_scheduler(read("scheduler")),
    )


def _without_position_ids(model: CLIPTextModel) -> CLIPTextModel:
    """CLIP's text tower without its one buffer: `build_on_device` rebuilds a module's buffers from
    its constructor's arguments, which CLIP's embeddings do not keep (`build_components` adds it)."""
    del _embeddings(model)._buffers["position_ids"]
    return model


def _embeddings(model: CLIPTextModel) -> nn.Module:
    """CLIP's text embeddings, wherever this transformers version puts them."""
    return next(module for name, module in model.named_modules() if name.endswith("embeddings"))


class Ready(logging.Handler):
    """Set once the service logs "ready:" (what `serve` and `tests/support/live.py` wait for) or the load
    fails (`on_fatal`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = threading.Event()
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("ready:"):
            self.event.set()

    def fail(self) -> None:
        self.failed = True
        self.event.set()


@contextmanager
def served(settings: Settings, components: Components, deadline_s: float) -> Iterator[str]:
    """The app on uvicorn, on a thread, on a loopback port bound here; its URL once the model is
    ready (an event, awaited up to `deadline_s`)."""
    ready, log = Ready(), logging.getLogger("diffshard")
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))  # "ready:" is an INFO line
    log.addHandler(ready)
    app = create_app(settings, on_fatal=ready.fail, components=components)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, name="uvicorn")
    thread.start()
    try:
        if not ready.event.wait(deadline_s) or ready.failed:
            why = app.state.runtime.error or f"not ready in {deadline_s:.0f} s"
            raise RuntimeError(f"the server did not start: {why}")
        yield f"http://127.0.0.1:{listening.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        listening.close()
        log.removeHandler(ready)


def stage_seconds(url: str) -> tuple[dict[str, float], int]:
    engine = httpx.get(f"{url}/v1/stats", timeout=30).json()["engine"]
    return engine["call_seconds_total"], engine["steps"]


def main() -> None:
    args = phase_parser(__doc__).parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("diffshard").setLevel(logging.INFO)  # the server's log, as `serve` writes it
    lines = Lines(args.lines)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    request = QUICK_REQUEST if args.quick else REQUEST
    configs = tiny_configs() if args.quick else PUBLISHED
    metrics_port = free_port()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "flux-dev", configs)
        components = build_components(folder, configs, torch.bfloat16, device)
        built_s = time.monotonic() - started
        settings = Settings(
            model=folder,
            model_name="FLUX.1-dev" + (" (tiny)" if args.quick else ""),
            devices=str(device),
            dtype="bfloat16",
            host="127.0.0.1",
            metrics_port=metrics_port,
            # eager: the compile phase measures compiling; a background compile would share the
            # device with this request
            compile="off",
            # one image: no timed search for a batch knee at startup, no reserve for 16 rows
            step_budget="off",
            max_batch=1,
        )
        with served(settings, components, READY_DEADLINE_S[args.device]) as url:
            ready_s = time.monotonic() - started
            before, steps_before = stage_seconds(url)
            asked = time.monotonic()
            response = httpx.post(f"{url}/v1/images/generations", json=request, timeout=600)
            request_s = time.monotonic() - asked
            after, steps_after = stage_seconds(url)
            exposition = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    images = []
    if response.status_code == 200:
        images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response.json()["data"]]
    stages = {call: round(after[call] - before[call], 3) for call in after}
    series = r'^diffshard_pipeline_call_seconds_total\{call="(\w+)"\} (\S+)$'
    exported = {call: round(float(seconds), 3) for call, seconds in re.findall(series, exposition, re.M)}
    width, height = (int(side) for side in request["size"].split("x"))
    steps = steps_after - steps_before
    ok = (
        response.status_code == 200
        and [image.size for image in images] == [(width, height)] * request["n"]
        and steps == request["num_inference_steps"]
        and exported.keys() == stages.keys()
    )
    lines.write(
        {
            "device": str(device),
            "model": settings.model_name,
            "built_s": round(built_s, 1),
            "ready_s": round(ready_s, 1),
            "request_s": round(request_s, 2),
            "status": response.status_code,
            "denoise_s": stages.get("step"),
            "encode_s": stages.get("start"),  # the prompts encoded (and the first noise drawn)
            "decode_s": stages.get("decode"),
            "steps": steps,
            "size": request["size"],
            "images": [f"{image.width}x{image.height} {image.mode}" for image in images],
            "metrics_call_seconds": exported,
            "error": None if response.status_code == 200 else response.text[:500],
        }
    )
    side = f"{width}²" if width == height else f"{width}x{height}"
    lines.write(
        {
            "headline": f"{settings.model_name} {side} {steps} steps served in {request_s:.2f} s "
            f"(denoise {stages.get('step', 0):.2f}, encode {stages.get('start', 0):.2f}, "
            f"decode {stages.get('decode', 0):.2f}; ready in {ready_s:.0f} s) on {device}"
            + ("" if ok else f"; FAILED: HTTP {response.status_code}, {len(images)} images, {steps} steps")
        }
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
