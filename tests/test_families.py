"""The transformer image families (SD3, FLUX.1, Qwen-Image, Qwen-Image-Edit and -2509, FLUX.2 [dev]
and [klein], Z-Image) on tiny folders built from config under fixed seeds, each held to its diffusers
pipeline: images alone and batched, split over two stages (bit-identical to one), a sequence group
of two, per-row LoRA (diffusers' and a trainer's keys), first-block caching beside adapted and
plain rows in one call, img2img or edits by reference, quantized encoders, the fake-GPU harness,
the served images over HTTP, and `plan --config` at published sizes. A family is a row of `CASES`."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import (
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxPipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3Pipeline,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
    ZImagePipeline,
)
from PIL import Image
from safetensors.torch import save_file

from server.engine import ModelShard, plan_shards
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.pipeline.loading.folder import read_family
from server.pipeline.steps.state import group_states
from server.requests import Edit, GenerationRequest
from server.requests.step_cache import StepCache
from tests.support.denoisers import sequence_lane
from tests.support.images import left_half_mask, source_image
from tests.support.live import live_server
from tests.support.lora import random_pairs
from tests.support.tiny_flux2 import build_flux2_folder, reference_image
from tests.support.tiny_qwen import (
    build_qwen_image_edit_folder,
    condition_image,
    load_qwen_image_edit,
)
from tests.support.tiny_qwenimage import build_qwen_image_folder

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Case:
    """A family's diffusers pipeline and the requests it is held to (its tiny folder: conftest's
    `tiny_folder` by the same name)."""

    reference: type
    requests: tuple[GenerationRequest, ...]  # the first is unguided, the second guided
    lora_targets: tuple[str, ...]  # the transformer's layers a LoRA adapts
    knobs: Callable[[GenerationRequest], dict[str, Any]]  # the pipeline's guidance arguments
    img2img: type | None = None  # its img2img pipeline, where edits start from the image
    inpaint: type | None = None  # and its inpainting pipeline
    edits_elsewhere: str = "edits by reference (below)"  # why img2img or inpaint is None
    absent: tuple[str, ...] = ()  # parts the folder leaves out, passed to the pipeline as None

    def load(self, reference: type, folder: Path) -> Any:
        """`reference` (this family's pipeline class, or its img2img or inpainting one) from the folder."""
        parts = dict.fromkeys(self.absent)
        pipe = reference.from_pretrained(folder, local_files_only=True, use_safetensors=True, **parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe


# the double blocks' attention and MLP, the single blocks' fused projection
FLUX2_TARGETS = ("attn.to_q", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out", "qkv_mlp_proj")
CASES = {
    "sd3": Case(
        StableDiffusion3Pipeline,
        (
            GenerationRequest("a red circle", guidance_scale=1.0, seed=3, steps=3, width=32, height=32),
            GenerationRequest(
                "a green square on a long white table",
                negative_prompt="blurry",
                guidance_scale=4.0,
                seed=4,
                steps=3,
                width=48,
                height=32,
            ),
        ),
        ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "ff.net.2"),
        lambda r: {"guidance_scale": r.guidance_scale},
        StableDiffusion3Img2ImgPipeline,
        edits_elsewhere="diffusers' SD3 inpainting decodes unshifted (diffusers#13611): test_edits.py",
        absent=("text_encoder_3", "tokenizer_3"),  # no T5: the pipeline feeds zeros, as we do
    ),
    "flux": Case(  # FLUX.1 [dev]: embedded guidance (one row), and true CFG with a negative prompt
        FluxPipeline,
        (
            GenerationRequest("a red circle", guidance_scale=3.5, seed=3, steps=3, width=32, height=32),
            GenerationRequest(
                "a green square on a long white table",
                negative_prompt="blurry",
                true_cfg_scale=4.0,
                guidance_scale=5.0,
                seed=4,
                steps=3,
                width=48,
                height=32,
            ),
        ),
        ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.2", "proj_mlp"),
        lambda r: {"guidance_scale": r.guidance_scale, "true_cfg_scale": r.true_cfg_scale or 1.0},
        FluxImg2ImgPipeline,
        FluxInpaintPipeline,
    ),
    "qwen-image": Case(
        QwenImagePipeline,
        (
            GenerationRequest("a red circle", seed=3, steps=3, width=32, height=32),
            GenerationRequest(
                "a green square on a long white table",
                negative_prompt="blurry",
                true_cfg_scale=3.0,
                seed=4,
                steps=3,
                width=48,
                height=32,
            ),
        ),
        ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "img_mlp.net.2"),
        lambda r: {"true_cfg_scale": r.true_cfg_scale},
        QwenImageImg2ImgPipeline,
        QwenImageInpaintPipeline,
    ),
    "z-image": Case(
        ZImagePipeline,
        (
            GenerationRequest("a red circle", seed=3, steps=3, width=32, height=32),
            GenerationRequest(
                "a green square on a long white table",
                negative_prompt="blurry",
                guidance_scale=3.0,
                seed=4,
                steps=3,
                width=48,
                height=32,
            ),
        ),
        ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w2"),
        lambda r: {"guidance_scale": r.guidance_scale},
        ZImageImg2ImgPipeline,
        ZImageInpaintPipeline,
    ),
    "flux2": Case(
        Flux2Pipeline,
        (
            GenerationRequest("a red circle", seed=3, steps=3, width=32, height=32),
            GenerationRequest(
                "a green square on a long white table",
                guidance_scale=2.5,
                seed=4,
                steps=3,
                width=48,
                height=32,
            ),
        ),
        FLUX2_TARGETS,
        lambda r: {"guidance_scale": r.guidance_scale},
    ),
    "flux2-klein": Case(
        Flux2KleinPipeline,
        (
            GenerationRequest("a red circle", guidance_scale=1.0, seed=3, steps=3, width=32, height=32),
            GenerationRequest(
                "a green square on a long white table",
                guidance_scale=3.0,
                seed=4,
                steps=3,
                width=48,
                height=32,
            ),
        ),
        FLUX2_TARGETS,
        lambda r: {"guidance_scale": r.guidance_scale},
    ),
}


@pytest.fixture(scope="module")
def built(tiny_folder) -> Callable[[str], Path]:
    """Each family's tiny folder by its `CASES` name: conftest's, shared with the scheduler table."""
    return tiny_folder


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, built) -> tuple[str, Path, Pipeline]:
    """(name, folder, its pipeline on one CPU)."""
    folder = built(request.param)
    return request.param, folder, Pipeline.load(folder, devices="cpu")


def theirs(name: str, folder: Path, request: GenerationRequest, lora: Path | None = None) -> np.ndarray:
    case = CASES[name]
    pipe = case.load(case.reference, folder)
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="style")
        pipe.set_adapters(["style"], [request.lora[0][1]])
    generator = torch.Generator("cpu").manual_seed(request.seed)
    negative = {} if request.negative_prompt is None else {"negative_prompt": request.negative_prompt}
    return pipe(
        prompt=request.prompt,
        **negative,
        num_inference_steps=request.steps,
        width=request.width,
        height=request.height,
        generator=generator,
        output_type="np",
        **case.knobs(request),
    ).images[0]


def test_images_equal_diffusers_alone_batched_and_split_over_two_stages(family) -> None:
    name, folder, one = family
    requests = [one.resolve(r) for r in CASES[name].requests]
    alone = [one.generate([r])[0] for r in requests]
    for request, mine in zip(requests, alone, strict=True):
        reference = theirs(name, folder, request)
        assert mine.shape == reference.shape == (request.height, request.width, 3)
        assert float(np.abs(mine - reference).max()) < TOLERANCE, request
        assert float(mine.std()) > 0.05  # not a flat image: the comparison means something
    same_size = [
        requests[0],
        one.resolve(
            GenerationRequest("a blue triangle", negative_prompt=" ", seed=9, steps=3, width=32, height=32)
        ),
    ]
    batched = one.generate(same_size)
    assert float(np.abs(batched[0] - alone[0]).max()) < TOLERANCE  # a guided, longer row beside it
    two = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    assert len(two.shard.plan.stages) == 2
    for split, whole in zip(two.generate(same_size), batched, strict=True):
        assert torch.equal(torch.from_numpy(split), torch.from_numpy(whole))


def test_a_sequence_group_of_two_gives_the_one_device_images(family) -> None:
    """Rows of prompts of different lengths (their padding masked) split by tokens over two ranks."""
    name, folder, one = family
    requests = [one.resolve(r) for r in CASES[name].requests]
    requests[1] = one.resolve(GenerationRequest(**{**vars(CASES[name].requests[1]), "width": 32}))
    lane = sequence_lane(folder)
    for split, alone in zip(lane.generate(requests), one.generate(requests), strict=True):
        assert float(np.abs(split - alone).max()) * 255 <= 2
    assert lane.lane.groups.calls == requests[0].steps


@pytest.mark.parametrize(
    ("masked", "strength"),
    [(False, 0.6), (True, 0.75), (True, 1.0)],
    ids=["img2img", "inpaint", "inpaint-full"],
)
def test_edits_equal_the_familys_img2img_and_inpaint_pipelines(family, masked: bool, strength: float) -> None:
    name, folder, one = family
    reference = CASES[name].inpaint if masked else CASES[name].img2img
    if reference is None:
        pytest.skip(f"{name}: {CASES[name].edits_elsewhere}")
    edit = Edit(source_image(), left_half_mask() if masked else None, strength, keep_unmasked=False)
    asked = {**vars(CASES[name].requests[1]), "edit": edit, "steps": 5, "width": None, "height": None}
    request = one.resolve(GenerationRequest(**asked))
    theirs = (
        CASES[name]
        .load(reference, folder)(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            image=edit.image,
            strength=strength,
            num_inference_steps=5,
            width=request.width,
            height=request.height,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(request.seed),
            **CASES[name].knobs(request),
            **({"mask_image": edit.mask} if masked else {}),
        )
        .images[0]
    )
    assert float(np.abs(one.generate([request])[0] - theirs).max()) < TOLERANCE


def test_a_group_whose_heads_do_not_split_gathers_keys_with_their_mask(tmp_path) -> None:
    """3 heads over 2 ranks: no Ulysses; each rank gathers every key, value and key mask (prompts
    of different lengths) and attends its own queries: within 2/255 of one device."""
    folder = build_qwen_image_folder(tmp_path / "three-heads", heads=3)
    one = Pipeline.load(folder, devices="cpu")
    requests = [one.resolve(replace(r, width=32)) for r in CASES["qwen-image"].requests]
    for split, alone in zip(sequence_lane(folder).generate(requests), one.generate(requests), strict=True):
        assert float(np.abs(split - alone).max()) * 255 <= 2


def test_prompts_of_other_lengths_make_calls_of_one_shape_which_compiled_graphs_serve(tiny_folder) -> None:
    """A call's text columns are its longest prompt's rounded up to 64, with the mask kept: calls
    of prompts a few tokens apart have one shape, so compiled graphs (per shape) serve them. The
    lengths are read once as a request starts and the columns cut on the host (read in the
    denoiser's `begin`, they waited for the GPU every call and kept `--compile full` from
    tracing a call whole, which it now may)."""
    from server.engine.denoisers.blocks import TEXT_MASK
    from server.engine.runtime.compile import CompileMode
    from server.engine.runtime.graphs import CompileStats, GraphStore
    from server.engine.runtime.pool import PoolScope

    pipeline = Pipeline.load(tiny_folder("qwen-image"), devices="cpu")
    requests = [
        pipeline.resolve(GenerationRequest("cat " * n, seed=1, steps=2, width=32, height=32))
        for n in (1, 20, 40, 80)
    ]
    with torch.inference_mode():
        states = pipeline.start(requests)
        try:
            assert [s.text_columns for s in states] == [9, 66, 126, 246]  # of 512, their template's cut
            for group, columns in (([0], 64), ([1], 128), ([2], 128), ([0, 2], 128), ([0, 1, 3], 256)):
                inputs = pipeline.stacked([states[i] for i in group], PoolScope(pipeline.pool))
                assert inputs.context.shape[1] == inputs.conditioning[TEXT_MASK].shape[1] == columns
                assert inputs.conditioning[TEXT_MASK].sum(1).tolist() == [
                    states[i].text_columns for i in group
                ]
        finally:
            for state in states:
                state.close()
    model = QwenImageTransformer2DModel(
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    shard = ModelShard(model, plan_shards(model, ["cpu"], "memory"))
    shard.compile(CompileMode.FULL, GraphStore(None, ["cpu"], CompileStats("full")))
    assert shard.compiled is not None


def random_lora(name: str, folder: Path, out: Path) -> Path:
    """A rank-4 LoRA on the transformer's attention and MLP, in diffusers' keys."""
    pipe = CASES[name].load(CASES[name].reference, folder)
    tensors: dict[str, torch.Tensor] = {}
    parts = (("transformer", pipe.transformer, CASES[name].lora_targets),)
    list(random_pairs(parts, torch.Generator().manual_seed(1), 4, tensors))
    save_file(tensors, out)
    return out


def test_lora_cached_and_plain_rows_share_calls_and_equal_alone_and_diffusers(family, tmp_path) -> None:
    name, folder, _ = family
    lora = random_lora(name, folder, tmp_path / "style.safetensors")
    pipeline = Pipeline.load(folder, devices="cpu")
    pipeline.add_adapter(read_adapter("style", lora, pipeline.family))
    base = CASES[name].requests[0]
    adapted = pipeline.resolve(GenerationRequest(**{**vars(base), "lora": (("style", 0.8),)}))
    cached = pipeline.resolve(
        GenerationRequest(
            **{**vars(base), "seed": 5, "steps": 4, "step_cache": StepCache("first_block", 3, 0.2)}
        )
    )
    plain = pipeline.resolve(GenerationRequest(**{**vars(base), "prompt": "a white square", "seed": 6}))
    alone = [pipeline.generate([r])[0] for r in (adapted, cached, plain)]
    assert float(np.abs(alone[0] - theirs(name, folder, adapted, lora)).max()) < TOLERANCE
    assert float(np.abs(alone[0] - pipeline.generate([base])[0]).max()) > 20 * TOLERANCE  # it adapts
    rows: list[int] = []
    step = pipeline.step
    pipeline.step = lambda states: (rows.append(len(states)), step(states))[1]
    together = pipeline.generate([adapted, cached, plain])
    assert rows[:3] == [3, 3, 3]  # the three requests in one call a step
    for one, joined in zip(alone, together, strict=True):
        assert float(np.abs(one - joined).max()) < TOLERANCE


def test_the_denoiser_and_the_language_model_encoder_quantize_and_still_draw_the_image(family) -> None:
    """`--quantize denoiser=int8-dynamic,text_encoder=int8-dynamic`: these families' encoders are
    4-24 B language models, as large as their transformers; both quantize and the image stays
    within a few 255ths of float32's (the tiny models' own drift)."""
    name, folder, one = family
    setting = "denoiser=int8-dynamic,text_encoder=int8-dynamic"
    quantized = Pipeline.load(folder, devices="cpu", quantize=setting)
    assert quantized.quantization == setting
    request = one.resolve(CASES[name].requests[0])
    drift = np.abs(quantized.generate([request])[0] - one.generate([request])[0])
    assert float(drift.mean()) > 0 and float(drift.max()) < 24 / 255, float(drift.max())


def test_a_kohya_trained_qwen_image_lora_loads_as_diffusers_converts_it(built, tmp_path) -> None:
    """sd-scripts' and Musubi's keys (`lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight`,
    an `.alpha` each) read through QwenImagePipeline's own converter: the image equals diffusers'
    after load_lora_weights of the same file."""
    folder = built("qwen-image")
    generator, tensors = torch.Generator().manual_seed(2), {}
    for block in range(2):
        for target, (fan_in, fan_out) in {"attn_to_q": (64, 64), "img_mlp_net_2": (256, 64)}.items():
            key = f"lora_unet_transformer_blocks_{block}_{target}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, fan_in, generator=generator) * 0.3
            tensors[f"{key}.lora_up.weight"] = torch.randn(fan_out, 4, generator=generator) * 0.3
            tensors[f"{key}.alpha"] = torch.tensor(8.0)  # scale 2: alpha / rank
    lora = tmp_path / "kohya.safetensors"
    save_file(tensors, lora)
    pipeline = Pipeline.load(folder, devices="cpu")
    pipeline.add_adapter(read_adapter("style", lora, pipeline.family))
    base = CASES["qwen-image"].requests[0]
    request = pipeline.resolve(GenerationRequest(**{**vars(base), "lora": (("style", 0.7),)}))
    mine = pipeline.generate([request])[0]
    assert float(np.abs(mine - theirs("qwen-image", folder, request, lora)).max()) < TOLERANCE
    assert float(np.abs(mine - pipeline.generate([base])[0]).max()) > 20 * TOLERANCE  # it adapts


def edits_over_http(folder: Path, url: str) -> None:
    """FLUX.2 [dev]'s edits: every `image[]` a reference of one request, within 2/255 of
    Flux2Pipeline's `image=`; a mask refused by name."""
    images = [reference_image(64), reference_image(80).rotate(90)]
    files = []
    for image in images:
        data = io.BytesIO()
        image.save(data, format="PNG")
        files.append(("image[]", ("ref.png", data.getvalue(), "image/png")))
    fields = {"prompt": "a red circle", "size": "32x32", "seed": "3", "num_inference_steps": "3"}
    with httpx.Client(base_url=url, timeout=120) as client:
        edited = client.post("/v1/images/edits", data=fields, files=files)
        masked = client.post("/v1/images/edits", data=fields, files=[*files[:1], ("mask", files[0][1])])
        family = client.get("/v1/models").json()["data"][0]["family"]
    assert edited.status_code == 200, edited.text
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(edited.json()["data"][0]["b64_json"]))))
    pipe = Flux2Pipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt="a red circle",
        image=images,
        num_inference_steps=3,
        width=32,
        height=32,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]
    assert int(np.abs(served.astype(int) - (theirs * 255).round().astype(int)).max()) <= 2
    assert masked.status_code == 400 and masked.json()["error"]["param"] == "mask"
    assert family["supports"]["edits"] == "by reference"


def png_pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def test_served_over_http_within_2_of_diffusers_streamed_and_described(family) -> None:
    """... and with the operator's defaults (`--default-steps 3`, and `--default-guidance 4`
    where the model has a guidance input): a request naming neither gets them, as the pipeline
    called with them draws it, and /v1/models shows them."""
    name, folder, one = family
    request = one.resolve(CASES[name].requests[1])
    extra = {
        "seed": request.seed,
        "num_inference_steps": request.steps,
        "negative_prompt": request.negative_prompt,
        **CASES[name].knobs(request),
    }
    size = f"{request.width}x{request.height}"
    guidance = 4.0 if one.family.takes_guidance else one.defaults.guidance_scale
    defaults = ("--default-steps", "3", *(("--default-guidance", "4") if one.family.takes_guidance else ()))
    with live_server("--model", str(folder), *defaults) as server:
        if name == "flux2":  # edits by reference on the same server
            edits_over_http(folder, server.url)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        plain = client.images.generate(prompt=request.prompt, size=size, extra_body=extra)
        events = list(
            client.images.generate(
                prompt=request.prompt, size=size, stream=True, partial_images=1, extra_body=extra
            )
        )
        unnamed = client.images.generate(prompt=request.prompt, size=size, extra_body={"seed": request.seed})
        listed = client.models.list().data[0].model_extra
    assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert base64.b64decode(events[-1].b64_json) == base64.b64decode(plain.data[0].b64_json)
    reference = (theirs(name, folder, request) * 255).round().astype(int)
    assert int(np.abs(png_pixels(plain.data[0].b64_json) - reference).max()) <= 2
    described = listed["family"]
    assert described["name"] == name and described["supports"]["step_caches"] == ["off", "first_block"]
    assert listed["defaults"] == {"num_inference_steps": 3, "guidance_scale": guidance}
    asked = replace(request, negative_prompt=None, steps=3, guidance_scale=guidance, true_cfg_scale=1.0)
    reference = (theirs(name, folder, asked) * 255).round().astype(int)
    assert int(np.abs(png_pixels(unnamed.data[0].b64_json) - reference).max()) <= 2


def test_a_published_dev_folder_naming_a_pixtral_processor_loads_its_text_tokenizer(tmp_path) -> None:
    """FLUX.2-dev's model_index.json names a PixtralProcessor, which transformers cannot build
    without torchvision: the loader takes the tokenizer it holds (its chat template in the older
    processors' chat_template.json) and the images match the plain tokenizer's."""
    folder = build_flux2_folder(tmp_path / "dev")
    request = GenerationRequest("a red circle", seed=3, steps=2, width=32, height=32)
    plain = Pipeline.load(folder, devices="cpu").generate([request])[0]
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    tokenizer = folder / "tokenizer"
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    template = settings.pop("chat_template", None) or (tokenizer / "chat_template.jinja").read_text()
    (tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    (tokenizer / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    published = Pipeline.load(folder, devices="cpu")
    assert published.components.tokenizers[0].chat_template == template
    assert np.array_equal(published.generate([request])[0], plain)


GIB = 2**30
FITS = {  # what must fit at published sizes in bfloat16 (issue 50): config, devices, budget, quantize
    "qwen-image on one 80 GiB GPU": ("qwen-image", "cuda:0", 80, "off"),
    "qwen-image on one 24 GiB GPU, 4-bit": ("qwen-image", "cuda:0", 24, "nf4"),
    "flux2-dev on two 80 GiB GPUs": ("flux2-dev", "cuda:0,cuda:1", 80, "off"),
    "flux2-dev on one 80 GiB GPU, int8": ("flux2-dev", "cuda:0", 80, "int8"),
    "z-image on one 24 GiB GPU": ("z-image", "cuda:0", 24, "off"),
    "flux2-klein-4b on one 24 GiB GPU": ("flux2-klein-4b", "cuda:0", 24, "off"),
}


@pytest.mark.parametrize("case", sorted(FITS))
def test_published_sizes_fit_where_their_users_run_them(case: str, capsys) -> None:
    """`plan --config` counts every part at its published size (text encoders of 4 to 24 B
    parameters included) on the meta device, and places them within the budget."""
    from server.__main__ import main

    config, devices, budget, quantize = FITS[case]
    budgets = ",".join(f"{d}={budget}GiB" for d in devices.split(","))
    args = ["plan", "--config", config, "--devices", devices, "--max-memory", budgets, "--dtype", "bfloat16"]
    assert main([*args, "--parallel", "off", "--quantize", quantize, "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    for device in plan["devices"]:
        held = device["param_bytes"] + device["activation_reserve"] + device["other_bytes"]
        assert held <= device["budget"] == budget * GIB
    assert sum(d["other_bytes"] for d in plan["devices"]) > 4 * GIB  # the text encoder is counted


@pytest.fixture(scope="module")
def flux2_folders(built) -> dict[str, Path]:
    return {"dev": built("flux2"), "klein-base": built("flux2-klein")}


def test_flux2_edits_by_reference_equal_the_pipelines_and_batch_by_layout(flux2_folders) -> None:
    """FLUX.2's edits: the images join the sequence as references (time 10, 20, ...), one or
    several, and equal Flux2(Klein)Pipeline's `image=`; requests of different reference layouts
    run in calls of their own, and each equals its image alone."""
    images = [reference_image(64), reference_image(80).rotate(90)]
    for variant, reference in (("dev", Flux2Pipeline), ("klein-base", Flux2KleinPipeline)):
        pipeline = Pipeline.load(flux2_folders[variant], devices="cpu")
        pipe = reference.from_pretrained(flux2_folders[variant], local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        edits = [Edit(images[0]), Edit(images[0], more=(images[1],))]
        requests = [
            pipeline.resolve(
                GenerationRequest(
                    "a red circle", seed=3, steps=3, width=32, height=32, guidance_scale=3.0, edit=edit
                )
            )
            for edit in edits
        ]
        alone = [pipeline.generate([r])[0] for r in requests]
        for request, mine in zip(requests, alone, strict=True):
            given = [request.edit.image, *request.edit.more]
            theirs = pipe(
                prompt=request.prompt,
                image=given if len(given) > 1 else given[0],
                num_inference_steps=3,
                guidance_scale=3.0,
                width=32,
                height=32,
                output_type="np",
                generator=torch.Generator("cpu").manual_seed(3),
            ).images[0]
            assert float(np.abs(mine - theirs).max()) < TOLERANCE, (variant, len(given))
        if variant == "dev":  # the reference tokens over two stages (bit for bit) and a group of two
            staged = Pipeline.load(flux2_folders[variant], devices="cpu,cpu", strategy="even")
            assert torch.equal(torch.from_numpy(staged.generate(requests[1:])[0]), torch.from_numpy(alone[1]))
            split = sequence_lane(flux2_folders[variant]).generate(requests[1:])[0]
            assert float(np.abs(split - alone[1]).max()) * 255 <= 2
        states = pipeline.start(requests)
        try:
            assert len(group_states(states)) == 2  # one image's tokens, two images': apart
        finally:
            for state in states:
                state.close()
        for one, together in zip(alone, pipeline.generate(requests), strict=True):
            assert float(np.abs(one - together).max()) < TOLERANCE


@pytest.fixture(scope="module")
def qwen_edit_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-edit")
    return {kind: build_qwen_image_edit_folder(root / kind, plus=kind == "plus") for kind in ("edit", "plus")}


@pytest.mark.parametrize("kind", ["edit", "plus"])
def test_qwen_image_edits_equal_the_edit_pipelines_alone_and_batched(qwen_edit_folders, kind: str) -> None:
    """Qwen-Image-Edit (one image) and Edit-2509 (two, "Picture 1: ..."): the images through the
    VL encoder with the prompt and as reference latents after the noise's, with and without
    true CFG; two edits of the same layout share every call and give their images alone."""
    images = [condition_image(0, 40), *([condition_image(1)] if kind == "plus" else [])]
    folder = qwen_edit_folders[kind]
    pipeline = Pipeline.load(folder, devices="cpu")
    pipe = load_qwen_image_edit(folder, plus=kind == "plus")
    pipe.set_progress_bar_config(disable=True)
    edit = Edit(images[0], more=tuple(images[1:]))
    sized = pipeline.resolve(GenerationRequest("make it red", edit=edit))
    assert (sized.width, sized.height) == (1024, 1024)  # the pipelines' default: ~1 MP at the image's ratio
    requests = [
        pipeline.resolve(
            GenerationRequest(
                prompt, negative_prompt=negative, seed=seed, steps=2, edit=edit, width=32, height=32
            )
        )
        for prompt, negative, seed in (("make it red", None, 3), ("a blue sky over it", "blurry", 4))
    ]
    alone = [pipeline.generate([r])[0] for r in requests]
    for request, mine in zip(requests[1:], alone[1:], strict=True):  # the guided one: both passes
        theirs = pipe(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            true_cfg_scale=4.0,
            image=images if kind == "plus" else images[0],
            num_inference_steps=2,
            output_type="np",
            width=32,
            height=32,
            generator=torch.Generator("cpu").manual_seed(request.seed),
        ).images[0]
        assert mine.shape == theirs.shape == (32, 32, 3)
        assert float(np.abs(mine - theirs).max()) < TOLERANCE, request.negative_prompt
    calls: list[int] = []
    step = pipeline.step
    pipeline.step = lambda states: (calls.append(len(states)), step(states))[1]
    for one, together in zip(alone, pipeline.generate(requests), strict=True):
        assert float(np.abs(one - together).max()) < TOLERANCE
    assert calls == [2, 2]
    if kind == "edit":  # the reference tokens over two stages (bit for bit) and a group of two
        staged = Pipeline.load(folder, devices="cpu,cpu", strategy="even").generate(requests[1:])[0]
        assert torch.equal(torch.from_numpy(staged), torch.from_numpy(alone[1]))
        assert float(np.abs(sequence_lane(folder).generate(requests[1:])[0] - alone[1]).max()) * 255 <= 2


def test_a_qwen_edit_model_wants_an_image_and_plus_takes_several_over_http(qwen_edit_folders) -> None:
    folder = qwen_edit_folders["plus"]
    files = []
    for seed in (0, 1):
        data = io.BytesIO()
        condition_image(seed).save(data, format="PNG")
        files.append(("image[]", (f"{seed}.png", data.getvalue(), "image/png")))
    fields = {
        "prompt": "make it red",
        "seed": "3",
        "num_inference_steps": "2",
        "negative_prompt": "blurry",
        "size": "32x32",
    }
    server = live_server("--model", str(folder))
    with server as running, httpx.Client(base_url=running.url, timeout=120) as client:
        edited = client.post("/v1/images/edits", data=fields, files=files)
        generated = client.post("/v1/images/generations", json={"prompt": "a red circle", "size": "32x32"})
    assert edited.status_code == 200, edited.text
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(edited.json()["data"][0]["b64_json"]))))
    pipe = load_qwen_image_edit(folder, plus=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt="make it red",
        negative_prompt="blurry",
        image=[condition_image(0), condition_image(1)],
        num_inference_steps=2,
        width=32,
        height=32,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]
    assert int(np.abs(served.astype(int) - (theirs * 255).round().astype(int)).max()) <= 2
    assert generated.status_code == 400 and generated.json()["error"]["param"] == "image"


@pytest.mark.parametrize("name", ["qwen-image", "z-image", "flux2"])
def test_a_guided_and_a_cached_row_step_over_two_fake_gpus(built, name: str) -> None:
    """The fake-GPU harness (tests/test_fake_gpu.py): the transformer split over fake cuda:0 and
    cuda:1, the encoders and VAE on the CPU; one call of a guided row beside a cached one lands on
    cuda:0 in the latents' shape: no tensor of the spec or the family is made on the wrong device."""
    from server.pipeline.loading.folder import load_components
    from tests.support.fake_cuda import FakeCuda

    components = load_components(built(name))
    model = components.denoiser
    plan = plan_shards(model, ["cpu", "cpu"], strategy="even")
    plan = replace(plan, stages=tuple(replace(s, device=f"cuda:{i}") for i, s in enumerate(plan.stages)))
    case = CASES[name]
    requests = [
        case.requests[1],  # guided where the family guides by rows
        GenerationRequest(**{**vars(case.requests[0]), "step_cache": StepCache("first_block", 3, 0.5)}),
    ]
    with FakeCuda(), torch.inference_mode():
        pipeline = Pipeline(components, ModelShard(model, plan), encoder_device="cpu")
        assert pipeline.shard.devices == ["cuda:0", "cuda:1"]
        states = pipeline.start([pipeline.resolve(replace(r, width=32, height=32)) for r in requests])
        try:
            assert {s.latents.device for s in states} == {torch.device("cuda:0")}
            with pipeline.pool.scope() as batch:
                inputs = pipeline.stacked(states, batch)
                result = pipeline.forward(inputs, pipeline.call_plan(states))
                assert result.out.device == torch.device("cuda:0") and result.out.shape == inputs.sample.shape
        finally:
            for state in states:
                state.close()


def test_operator_defaults_a_model_cannot_serve_stop_the_start(built) -> None:
    """Named with the setting: guidance for a model without a guidance input, steps over the limit."""
    from server.errors import ConfigError
    from server.pipeline.resolve import read_defaults
    from server.settings import Settings
    from server.startup import request_defaults

    folder = built("qwen-image")
    family = read_family(folder)
    defaults = read_defaults(folder, family)
    with pytest.raises(ConfigError, match=r"^--default-guidance .*no guidance input"):
        request_defaults(Settings(model=folder, default_guidance=4), family, defaults)
    with pytest.raises(ConfigError, match=r"^--default-steps .*150 is over --max-steps \(100\)"):
        request_defaults(Settings(model=folder, default_steps=150), family, defaults)
    fitted = request_defaults(Settings(model=folder, default_steps=20), family, defaults)
    assert (fitted.steps, fitted.guidance_scale) == (20, defaults.guidance_scale)
