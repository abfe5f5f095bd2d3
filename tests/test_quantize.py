"""Quantized weights (`--quantize`, `--denoiser-file`): images against diffusers' own quantized
pipelines, bytes held, LoRA rows and stages on a quantized base."""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
    GGUFQuantizationConfig,
    PipelineQuantizationConfig,
    StableDiffusionPipeline,
    TorchAoConfig,
)
from PIL import Image

from server.demo import MODEL_DIR
from server.demo.dataset import all_prompts
from server.demo.evaluate import classify
from server.engine.hardware.devices import planning_absent_devices
from server.engine.quantize import Quantization, QuantMode, refusal, stored_bytes, torchao_config
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.pipeline.families import Family, Flux, reference_family
from server.pipeline.loading.model_plan import fits_by_mode, largest_side, plan_model
from server.pipeline.loading.quantized_parts import float8_speed, parse_quantize, part_quantizations
from server.requests import Edit, GenerationRequest
from tests.support.denoisers import split_lone
from tests.support.images import left_half_mask, source_image
from tests.support.live import live_server
from tests.support.lora import random_lora
from tests.support.tiny_pipelines import IMAGE_SIZE, diffusers_image, write_gguf

PIXEL = 2 / 255  # the issue's bound for a quantized image against diffusers' quantized one


def test_int8_sd15_equals_diffusers_own_quantized_pipeline(folders: dict[str, Path]) -> None:
    folder = folders["sd15"]
    request = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=6, guidance_scale=4.0)
    pipeline = Pipeline.load(folder, devices="cpu", quantize="int8")
    attention = pipeline.components.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    assert type(attention.to_q.weight).__name__ == "Int8Tensor"
    ours = pipeline.generate([request])[0]
    assert Family.keep_precise == ()  # a UNet's every Linear is quantized, as diffusers' default
    config = TorchAoConfig(torchao_config(QuantMode.INT8))
    pipe = StableDiffusionPipeline.from_pretrained(
        folder,
        dtype=torch.float32,
        quantization_config=PipelineQuantizationConfig(quant_mapping={"unet": config}),
    )
    pipe.set_progress_bar_config(disable=True)
    theirs = diffusers_image(pipe, pipeline.resolve(request))
    assert np.abs(ours - theirs).max() <= PIXEL
    assert ((ours > 0.01) & (ours < 0.99)).mean() > 0.5, "a saturated image would hide differences"


def test_flux_from_a_gguf_q8_file_equals_diffusers_from_single_file(
    flux_folder: Path, tmp_path: Path
) -> None:
    file = write_gguf(flux_folder, "transformer", tmp_path / "transformer-Q8_0.gguf")
    request = GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32)
    pipeline = Pipeline.load(flux_folder, devices="cpu,cpu", strategy="even", denoiser_file=file)
    assert pipeline.quantization == "denoiser=gguf:transformer-Q8_0.gguf"
    ours = pipeline.generate([pipeline.resolve(request)])[0]
    transformer = FluxTransformer2DModel.from_single_file(
        str(file),
        config=str(flux_folder),
        subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
        local_files_only=True,
    )
    pipe = FluxPipeline.from_pretrained(flux_folder, transformer=transformer, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = diffusers_image(pipe, pipeline.resolve(request))
    unquantized = Pipeline.load(flux_folder, devices="cpu").generate([pipeline.resolve(request)])[0]
    assert np.abs(ours - theirs).max() <= PIXEL
    assert np.abs(ours - unquantized).max() > 0, "the file's weights are Q8_0's, not the folder's"
    assert float(ours.std()) > 0.05
    # the plan read the file's header: what each stage holds, before loading it
    planned = plan_model(
        pipeline.family,
        "cpu,cpu",
        "even",
        dtype=torch.float32,
        batch=2,
        side=32,
        folder=flux_folder,
        parallel="off",
        denoiser_file=file,
    )
    stages = planned.replicas[0].stages
    assert [s.param_bytes for s in stages] == [s.param_bytes for s in pipeline.shard.plan.stages]
    assert sum(s.param_bytes for s in stages) == sum(m.shard_bytes for m in pipeline.shard.memory().values())


def test_int8_flux_holds_under_0_4_of_its_float32_denoiser_bytes(flux_folder: Path) -> None:
    full = Pipeline.load(flux_folder, devices="cpu,cpu", strategy="even")
    int8 = Pipeline.load(flux_folder, devices="cpu,cpu", strategy="even", quantize="int8")
    held = {
        name: sum(m.shard_bytes for m in p.shard.memory().values())
        for name, p in (("full", full), ("int8", int8))
    }
    assert held["int8"] <= 0.4 * held["full"], held
    # the plan counts what the shard holds (both stages are on "cpu"), and says what it saved
    stages = int8.shard.plan.stages
    assert sum(s.param_bytes for s in stages) == held["int8"]
    assert all(s.unquantized_bytes > 2.5 * s.param_bytes for s in stages)


def test_mixed_lora_and_plain_rows_on_an_int8_base_equal_each_alone(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """Each row within 2/255 of its image alone, and far from its adapter at a neighbouring scale.
    Not 1e-3: int8-dynamic rounds each token's activations to 255 levels, so the ~1e-7 a batch
    moves a float32 input by (the text encoder's and attention's kernels block a batch otherwise)
    flips a level now and then: 3.4e-3 on an AVX-512 Xeon without bf16, 0 on a Zen 4 EPYC."""
    folder = folders["sd15"]
    style = random_lora(folder, tmp_path / "style.safetensors", 1, "sd15")
    pipeline = Pipeline.load(folder, devices="cpu", quantize="int8-dynamic")
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    requests = [
        GenerationRequest("a red circle", seed=1, steps=4, lora=(("style", 0.8),)),
        GenerationRequest("a blue square", seed=2, steps=4),
        GenerationRequest("a green star", seed=3, steps=4, lora=(("style", 0.4),)),
    ]
    together = pipeline.generate(requests)
    alone = [pipeline.generate([r])[0] for r in requests]
    for mixed, single in zip(together, alone, strict=True):
        assert np.abs(mixed - single).max() <= 2 / 255
    assert np.abs(alone[0] - pipeline.generate([replace(requests[0], lora=())])[0]).max() > 0.01, (
        "the adapter acts"
    )
    neighbour = pipeline.generate([replace(requests[2], lora=(("style", 0.5),))])[0]
    assert np.abs(alone[2] - neighbour).max() > 3 * 2 / 255  # a row given another's scale would show


def test_lora_rows_on_a_gguf_base_act_and_mix_with_plain_rows(sd3_folder: Path, tmp_path: Path) -> None:
    """A GGUF layer's weight is packed (uint8 blocks, not [out, in]): an adapter is checked by the
    layer's in and out features and its delta added in its compute dtype (before: every LoRA was
    refused as not fitting). Its rows mix with plain ones; it changes the image as it does over the
    unquantized base, within the quantization's own difference."""
    file = write_gguf(sd3_folder, "transformer", tmp_path / "transformer-Q8_0.gguf")
    style = random_lora(sd3_folder, tmp_path / "style.safetensors", 1, "sd3")
    bases = {
        "gguf": Pipeline.load(sd3_folder, devices="cpu", denoiser_file=file),
        "full": Pipeline.load(sd3_folder, devices="cpu"),
    }
    adapted = GenerationRequest("a red circle", seed=1, steps=3, width=32, height=32, lora=(("style", 0.8),))
    plain = replace(adapted, prompt="a blue square", seed=2, lora=())
    images = {}
    for name, pipeline in bases.items():
        pipeline.add_adapter(read_adapter("style", style, pipeline.family))
        requests = [pipeline.resolve(r) for r in (adapted, plain, replace(adapted, lora=()))]
        images[name] = [pipeline.generate([r])[0] for r in requests]
        together = pipeline.generate(requests[:2])
        assert all(np.abs(a - b).max() < 1e-3 for a, b in zip(together, images[name][:2], strict=True))
    gguf, full = images["gguf"], images["full"]
    assert np.abs(gguf[0] - gguf[2]).max() > 0.05, "the adapter acts on the GGUF base"
    quantization = np.abs(gguf[2] - full[2]).max()
    assert np.abs((gguf[0] - gguf[2]) - (full[0] - full[2])).max() <= 2 * quantization + 0.01


def test_a_quantized_model_split_over_two_stages_equals_it_on_one_device(folders: dict[str, Path]) -> None:
    request = GenerationRequest("a red circle", seed=3, steps=4)
    one = Pipeline.load(folders["sdxl"], devices="cpu", quantize="int8").generate([request])[0]
    two = Pipeline.load(folders["sdxl"], devices="cpu,cpu", strategy="even", quantize="int8").generate(
        [request]
    )[0]
    assert np.abs(one - two).max() < 1e-3


def test_a_lone_request_on_int8_replicas_splits_over_both_and_gives_the_one_replica_image(
    folders: dict[str, Path],
) -> None:
    request = [GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=5.0)]
    alone = Pipeline.load(folders["sd15"], devices="cpu", quantize="int8").generate(request)[0]
    image, busy, _ = split_lone(folders["sd15"], request, quantize="int8")
    assert np.abs(image - alone).max() < 1e-3
    assert all(seconds > 0 for seconds in busy.values()) and len(busy) == 2, busy


def test_the_setting_by_mode_and_by_part() -> None:
    assert parse_quantize("off") == {} and parse_quantize("int8") == {"*": QuantMode.INT8}
    assert parse_quantize("denoiser=int8-dynamic, text_encoder_2=int8") == {
        "denoiser": QuantMode.INT8_DYNAMIC,
        "text_encoder_2": QuantMode.INT8,
    }
    for bad in ("int4", "denoiser=int4", "denoiser=int8,denoiser=off", "=int8"):
        with pytest.raises(ValueError, match=r"write|twice"):
            parse_quantize(bad)
    # alone: the denoiser, and text encoders over 1 GiB only (FLUX.1's T5, not its CLIP)
    flux = reference_family("flux-dev")
    parts = part_quantizations(parse_quantize("int8"), flux, {"text_encoder": 2**28, "text_encoder_2": 2**33})
    assert set(parts) == {"transformer", "text_encoder_2"}
    assert parts["transformer"].keep == Flux.keep_precise and parts["text_encoder_2"].keep == ()


def test_modes_a_device_cannot_run_are_refused_naming_it() -> None:
    assert refusal(QuantMode.INT8_DYNAMIC, "cpu") is None
    for mode in (QuantMode.FLOAT8, QuantMode.NF4):
        message = refusal(mode, "cpu")
        assert message is not None and "cpu runs off, int8, int8-dynamic" in message


def test_bytes_are_counted_from_shapes_as_quantized_tensors_hold_them() -> None:
    linear = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32))
    quantization = Quantization(QuantMode.INT8, keep=("1",))
    counted = quantization.bytes(linear, torch.float32)
    assert quantization.apply(linear) == 1
    assert counted == sum(stored_bytes(t) for t in linear.state_dict().values())
    assert stored_bytes(linear[0].weight) < linear[0].weight.numel() * 4 / 3


def test_flux_dev_fits_one_24_gib_gpu_or_two_16_gib_ones_in_int8_not_unquantized() -> None:
    family = reference_family("flux-dev")
    side = largest_side(family, int(family.default_area * family.native_size**2))
    with planning_absent_devices():
        plan = plan_model(
            family,
            "cuda:0",
            "memory",
            dtype=torch.bfloat16,
            batch=16,
            side=side,
            max_memory="cuda:0=24GiB",
            parallel="off",
            quantize=parse_quantize("int8"),
        )
        (stage,) = plan.replicas[0].stages
        assert stage.unquantized_bytes > 22 * 2**30 > 12 * 2**30 > stage.param_bytes
        for devices, budgets in (("cuda:0", "cuda:0=24GiB"), ("cuda:0,cuda:1", "cuda:0=16GiB,cuda:1=16GiB")):
            modes = fits_by_mode(
                family, devices, dtype=torch.bfloat16, batch=16, side=side, max_memory=budgets
            )
            assert not modes["off"]["fits"] and "short" in modes["off"]["why"]
            assert modes["int8"]["fits"] and modes["int8"]["stages"] == devices.split(",")
            # T5-XXL (the one text encoder over 1 GiB) is quantized too; CLIP and the VAE are not
            assert modes["int8"]["other_bytes"] < 0.6 * modes["off"]["other_bytes"]


@pytest.mark.slow
def test_the_built_in_model_in_int8_still_draws_what_it_is_asked() -> None:
    """The evaluator's gate (≥ 90% color, ≥ 80% shape) over every prompt, one seed each, as
    served; `python -m benchmarks.quality.quantize` runs the gate for each mode and 4 seeds
    (int8-dynamic too, which quantizes this tiny model's every activation: ~2x slower)."""
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu", quantize="int8")
    prompts = list(all_prompts())
    images = pipeline.generate([GenerationRequest(prompt, seed=0) for _, _, prompt in prompts])
    verdicts = [classify(image) for image in images]
    color = np.mean([v.color == c for v, (c, _, _) in zip(verdicts, prompts, strict=True)])
    shape = np.mean([v.shape == s for v, (_, s, _) in zip(verdicts, prompts, strict=True)])
    assert color >= 0.9 and shape >= 0.8, (color, shape)


def test_a_quantized_flux_server_says_what_it_serves_and_serves_it(flux_folder: Path) -> None:
    """Through uvicorn and the official SDK: /v1/models and /v1/shards name the quantization,
    the shards hold the int8 bytes, and an image comes back as the pipeline draws it."""
    request = GenerationRequest("a red circle", seed=4, steps=3, width=32, height=32)
    expected = Pipeline.load(flux_folder, devices="cpu", quantize="int8").generate([request])[0]
    with live_server("--model", str(flux_folder), "--devices", "cpu", "--quantize", "int8") as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
        assert (models["quantization"], models["dtype"]) == ("int8", "float32")
        shards = httpx.get(f"{server.url}/v1/shards", timeout=30).json()
        assert shards["quantization"] == "int8"
        held = sum(d["memory"]["shard_bytes"] for d in shards["devices"].values())
        assert held == sum(s["param_bytes"] for s in shards["plan"]["stages"])
        assert held < 0.4 * sum(s["unquantized_bytes"] for s in shards["plan"]["stages"])
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.images.generate(
            prompt="a red circle", size="32x32", extra_body={"seed": 4, "num_inference_steps": 3}
        )
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), dtype=np.float32)
    assert np.abs(image / 255 - expected).max() <= 1 / 255 + 1e-6  # PNG's rounding


def test_an_inpainting_edit_beside_a_plain_request_on_an_int8_base_equals_it_alone(
    folders: dict[str, Path],
) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu", quantize="int8")
    inpaint = Edit(source_image(), left_half_mask(), 0.8)
    edit = GenerationRequest("a green square", seed=2, steps=5, edit=inpaint)
    plain = GenerationRequest("a red circle", seed=1, steps=5)
    together = pipeline.generate([edit, plain])
    alone = [pipeline.generate([r])[0] for r in (edit, plain)]
    for mixed, single in zip(together, alone, strict=True):
        assert np.abs(mixed - single).max() < 1e-3
    kept = np.asarray(source_image(), dtype=np.float32)[:, IMAGE_SIZE // 2 :] / 255
    assert np.abs(together[0][:, IMAGE_SIZE // 2 :] - kept).max() < 1e-6  # the unmasked half is the image's


def test_float8_leaves_the_layers_the_loader_keeps_in_float32() -> None:
    """Wan's time embedder is in `_keep_in_fp32_modules`: diffusers holds it in float32 under any
    dtype, and torchao's float8 refuses float32 weights (the lent H100 found `--quantize float8`
    failing on Wan's first time-embedder layer); int8 converts float32 weights as any other."""
    from diffusers import WanTransformer3DModel

    from server.pipeline.families.wan import Wan

    with torch.device("meta"):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
        )
    names = {mode: [n for n, _ in Quantization(mode, Wan.keep_precise).targets(model)] for mode in QuantMode}
    for mode in (QuantMode.FLOAT8, QuantMode.INT8):
        assert {"blocks.0.ffn.net.0.proj", "condition_embedder.text_embedder.linear_1"} <= set(names[mode])
    assert not [n for n in names[QuantMode.FLOAT8] if "time_embedder" in n.split(".")]
    assert "condition_embedder.time_embedder.linear_1" in names[QuantMode.INT8]  # int8 takes float32
    # block by block, as float8 converts while placing: a part alone keeps the root's float32 list
    float8 = Quantization(QuantMode.FLOAT8, Wan.keep_precise)
    part = model.get_submodule("condition_embedder")
    fp32 = model._keep_in_fp32_modules
    by_part = [n for n, _ in float8.targets(part, "condition_embedder", fp32)]
    assert by_part == [n for n in names[QuantMode.FLOAT8] if n.startswith("condition_embedder.")] != []


def test_float8_quantizes_an_all_zero_activation_row_to_zeros_not_nan() -> None:
    """Wan's text context is zeros after each prompt's tokens: without a floor under the row's
    scale (0), torchao quantizes such a row to 0/0 = NaN (the lent H100's NaN float8 videos). The
    quantization step itself runs on a CPU; float8 matmuls do not."""
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    config = torchao_config(QuantMode.FLOAT8)
    rows = torch.randn(4, 32, dtype=torch.bfloat16)
    rows[2] = 0
    scale = _choose_scale_float8(rows, [1, 32], hp_value_lb=config.activation_value_lb)
    quantized = _quantize_affine_float8(rows, scale, config.activation_dtype).float()
    assert torch.isfinite(quantized).all() and quantized[2].eq(0).all()
    assert quantized[0].ne(0).any()


def test_float8_counts_only_the_layers_torchao_converts() -> None:
    """torchao's float8 leaves a Linear layer alone unless both sides are multiples of 16 (the
    lent H100 converted nothing of a 12-wide tiny Wan): the planner's bytes follow it."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 24), torch.nn.Linear(24, 32))
    names = [name for name, _ in Quantization(QuantMode.FLOAT8).targets(model)]
    assert names == ["0"]
    assert [name for name, _ in Quantization(QuantMode.INT8).targets(model)] == ["0", "1", "2"]
    assert Quantization(QuantMode.FLOAT8).bytes(model, torch.bfloat16) == (
        32 * 64 + 64 * 4 + 64 * 2 + (64 * 24 + 24 + 24 * 32 + 32) * 2
    )


def test_float8_says_at_startup_whether_it_is_a_memory_choice_or_compiled_to_pay() -> None:
    """Eager float8 steps are slower than bfloat16's on the GPUs measured: with nothing compiled
    the start says float8 is a memory choice; compiled, that its buckets are kept where faster."""
    assert "a memory choice" in float8_speed(parse_quantize("float8"), "off")
    assert "a memory choice" in float8_speed(parse_quantize("denoiser=float8"), "auto: off")
    assert "compiled" in float8_speed(parse_quantize("float8"), "auto: blocks")
    assert float8_speed(parse_quantize("text_encoder_2=float8"), "off") is None  # the denoiser's steps
    assert float8_speed(parse_quantize("int8"), "off") is None
