"""LoRA adapters per row (issue 23), in process on the tiny SD-1.5- and SDXL-shaped folders: a
request's adapters at its scales give diffusers' image after `load_lora_weights` and
`set_adapters`; a request without adapters is the base model's, bit for bit; requests with
different adapters stepped together give the images each gives alone. Adapters are random,
built here under fixed seeds, in the diffusers/PEFT file format (safetensors)."""

from __future__ import annotations

import base64
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import (
    FluxPipeline,
    StableDiffusionPipeline,
)
from safetensors.torch import load_file, save_file

from server.demo import MODEL_DIR
from server.engine.runtime.call import AdapterRows
from server.errors import ConfigError, InvalidRequest, ModelFolderError
from server.pipeline import Pipeline
from server.pipeline.conditioning.adapters import RowsMismatch
from server.pipeline.conditioning.lora_keys import read_adapter
from server.pipeline.steps.schedulers import make_scheduler
from server.requests import GenerationRequest
from server.settings import Settings
from tests.support.live import LiveServer, free_port, live_server
from tests.support.lora import NO_T5, RANK, REFERENCE, TEXT_TARGETS, UNET_TARGETS, random_lora, random_pairs
from tests.support.tiny_pipelines import diffusers_image

# diffusers' reference pipeline, given a second adapter, says peft holds several: as it should
pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def loras(folders: dict[str, Path], sd3_folder: Path, tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("loras")
    folders = {**folders, "sd3": sd3_folder}
    return {
        kind: {
            name: random_lora(folders[kind], root / f"{kind}-{name}.safetensors", seed, kind)
            for name, seed in (("A", 1), ("B", 2))
        }
        for kind in REFERENCE
    }


def ours(folder: Path, kind: str, files: dict[str, Path], devices: str = "cpu,cpu") -> Pipeline:
    """Split in two stages, so adapters also work through the ModelShard's hooks."""
    pipeline = Pipeline.load(folder, devices=devices, strategy="even")
    for name, path in files.items():
        pipeline.add_adapter(read_adapter(name, path, pipeline.family))
    return pipeline


def theirs(folder: Path, kind: str, files: dict[str, Path], scales: dict[str, float], request) -> np.ndarray:
    pipe = REFERENCE[kind].from_pretrained(
        folder, local_files_only=True, use_safetensors=True, **NO_T5.get(kind, {})
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler(pipe.scheduler, request.scheduler or "default")
    for name, path in files.items():
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    pipe.set_adapters(list(scales), list(scales.values()))
    return diffusers_image(pipe, request)


def request(lora: dict[str, float], seed: int = 3) -> GenerationRequest:
    return GenerationRequest(
        "a red circle",
        negative_prompt="blue",
        seed=seed,
        steps=5,
        guidance_scale=4.0,
        lora=tuple(lora.items()),
    )


@pytest.mark.parametrize("kind", sorted(REFERENCE))
@pytest.mark.parametrize("scales", [{"A": 0.7}, {"A": 0.7, "B": 0.4}], ids=["A", "A+B"])
def test_a_request_s_adapters_give_diffusers_image_after_set_adapters(
    folders, sd3_folder, loras, kind: str, scales: dict[str, float]
) -> None:
    folders = {**folders, "sd3": sd3_folder}
    pipeline = ours(folders[kind], kind, loras[kind])
    mine = pipeline.generate([request(scales)])[0]
    reference = theirs(folders[kind], kind, loras[kind], scales, pipeline.resolve(request(scales)))
    base = pipeline.generate([request({})])[0]
    assert float(np.abs(mine - reference).max()) < TOLERANCE
    assert float(np.abs(mine - base).max()) > 20 * TOLERANCE  # the adapter changes the image


def test_a_request_without_adapters_is_the_base_model_bit_for_bit(folders, loras) -> None:
    plain = Pipeline.load(folders["sd15"], devices="cpu,cpu", strategy="even").generate([request({})])[0]
    loaded = ours(folders["sd15"], "sd15", loras["sd15"]).generate([request({})])[0]
    np.testing.assert_array_equal(plain, loaded)


def test_mixed_adapters_in_one_call_give_the_images_they_give_alone(folders, loras) -> None:
    pipeline = ours(folders["sd15"], "sd15", loras["sd15"], devices="cpu")
    choices = [{}, {"A": 1.0}, {"B": 0.5}, {"A": 0.6, "B": -0.8}]
    requests = [request(choice, seed=i) for i, choice in enumerate(choices)]
    alone = [pipeline.generate([r])[0] for r in requests]
    rows_per_call: list[int] = []
    step = pipeline.step
    pipeline.step = lambda states: (rows_per_call.append(sum(s.rows for s in states)), step(states))[1]
    together = pipeline.generate(requests)
    assert set(rows_per_call) == {8}  # every step: one denoiser call with all four requests' rows
    for one, joined in zip(alone, together, strict=True):
        assert float(np.abs(one - joined).max()) < TOLERANCE
    assert float(np.abs(alone[1] - alone[3]).max()) > 20 * TOLERANCE  # the choices do differ


def test_unknown_adapters_and_files_that_do_not_fit_are_refused_by_name(folders, loras, tmp_path) -> None:
    pipeline = ours(folders["sd15"], "sd15", {"A": loras["sd15"]["A"]}, devices="cpu")
    with pytest.raises(InvalidRequest, match="no adapter named 'C'"):
        pipeline.resolve(request({"C": 1.0}))
    sdxl_file = loras["sdxl"]["A"]  # another architecture's adapter: its layers do not fit
    with pytest.raises(ModelFolderError, match=r"does not fit this model: .*attn"):
        pipeline.add_adapter(read_adapter("X", sdxl_file, pipeline.family))
    with pytest.raises(ModelFolderError, match="two adapters are named 'A'"):
        pipeline.add_adapter(read_adapter("A", loras["sd15"]["B"], pipeline.family))
    pickle = tmp_path / "adapter.bin"
    pickle.write_bytes(b"not safetensors")
    with pytest.raises(ModelFolderError, match=r"not a \.safetensors file"):
        read_adapter("P", pickle, pipeline.family)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The built-in model with a random adapter `style`, one lane."""
    path = random_lora(MODEL_DIR, tmp_path_factory.mktemp("served") / "style.safetensors", 7, "sd15")
    metrics_port = free_port()
    with live_server(
        "--lora", f"style={path}", "--threads", "1", "--metrics-port", str(metrics_port)
    ) as running:
        running.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield running


def test_over_http_the_sdk_asks_for_adapters_streamed_or_not_and_bad_ones_get_400(served: LiveServer) -> None:
    listed = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"][0]["adapters"]
    assert [(a["name"], a["rank"], a["parts"]) for a in listed] == [("style", RANK, ["text_encoder", "unet"])]
    assert {"attn1.to_q", "attn2.to_out.0", "self_attn.q_proj"} <= set(listed[0]["targets"])
    assert listed[0]["bytes"] > 0
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    extra = {"seed": 5, "num_inference_steps": 6}

    def image(**body) -> bytes:
        return base64.b64decode(
            client.images.generate(prompt="a red circle", extra_body={**extra, **body}).data[0].b64_json
        )

    styled, plain = image(lora={"style": 1.5}), image()
    assert styled != plain
    events = list(
        client.images.generate(
            prompt="a red circle", stream=True, partial_images=1, extra_body={**extra, "lora": {"style": 1.5}}
        )
    )
    assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert base64.b64decode(events[-1].b64_json) == styled
    for lora, words in (({"nope": 1.0}, "no adapter named 'nope'"), ({"style": 9.0}, "between -4 and 4")):
        with pytest.raises(openai.BadRequestError, match=words) as caught:
            image(lora=lora)
        assert caught.value.param == "lora"
    metrics = httpx.get(served.metrics_url, timeout=10).text
    assert 'diffshard_lora_requests_total{adapter="style"} 2.0' in metrics  # the plain one and the stream
    assert 'diffshard_lora_rows_total{adapter="style"} 24.0' in metrics  # 2 requests x 6 steps x 2 rows
    placed = re.search(r'diffshard_lora_bytes\{device="cpu"\} (\S+)', metrics)
    assert placed and float(placed.group(1)) == listed[0]["bytes"]
    # no admin keys here, so every caller would be one: adapters never change at runtime
    refused = httpx.post(f"{served.url}/v1/adapters", json={"name": "style"}, timeout=10)
    assert refused.status_code == 403 and "--admin-key-file" in refused.json()["error"]["message"]


def kohya(peft_file: Path, out: Path, alpha: float) -> Path:
    """The same adapter in kohya's A1111 format: `lora_unet_<module_with_underscores>.lora_down.weight`,
    `.lora_up.weight` and an `.alpha` each (here not the rank: its scaling must be read)."""
    tensors: dict[str, torch.Tensor] = {}
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_text_model_"}
    for key, tensor in load_file(peft_file).items():
        part, _, rest = key.partition(".")
        module, kind = rest.rsplit(".lora_", 1)
        name = prefixes[part] + module.replace(".", "_")
        tensors[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = tensor
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(tensors, out)
    return out


def test_kohya_files_are_read_as_diffusers_reads_them(folders, loras, tmp_path) -> None:
    path = kohya(loras["sd15"]["A"], tmp_path / "kohya.safetensors", alpha=2.0)
    pipeline = ours(folders["sd15"], "sd15", {"K": path}, devices="cpu")
    adapter = pipeline.adapters.loaded["K"]
    assert adapter.rank == RANK and {p.alpha for pairs in adapter.parts.values() for p in pairs.values()} == {
        2.0
    }
    assert sum(map(len, adapter.parts.values())) == len(load_file(loras["sd15"]["A"])) // 2  # every layer
    mine = pipeline.generate([request({"K": 0.9})])[0]
    reference = theirs(
        folders["sd15"], "sd15", {"K": path}, {"K": 0.9}, pipeline.resolve(request({"K": 0.9}))
    )
    assert float(np.abs(mine - reference).max()) < TOLERANCE


def test_alphas_in_diffusers_metadata_are_read_per_part_and_per_pattern(folders, loras, tmp_path) -> None:
    """`save_lora_weights` writes each part's peft config under its prefix (`unet.lora_alpha`,
    `unet.alpha_pattern`): alpha ≠ rank must scale as diffusers scales it."""
    tensors = load_file(loras["sd15"]["A"])
    parts = {
        part: {k.removeprefix(f"{part}."): v for k, v in tensors.items() if k.startswith(f"{part}.")}
        for part in ("unet", "text_encoder")
    }
    config = {"r": RANK, "lora_alpha": 2 * RANK}
    StableDiffusionPipeline.save_lora_weights(
        tmp_path,
        unet_lora_layers=parts["unet"],
        text_encoder_lora_layers=parts["text_encoder"],
        weight_name="alphas.safetensors",
        unet_lora_adapter_metadata={
            **config,
            "target_modules": list(UNET_TARGETS),
            "alpha_pattern": {"to_q": 1},
        },
        text_encoder_lora_adapter_metadata={**config, "target_modules": list(TEXT_TARGETS)},
    )
    path = tmp_path / "alphas.safetensors"
    pipeline = ours(folders["sd15"], "sd15", {"M": path}, devices="cpu")
    unet = pipeline.adapters.loaded["M"].parts["unet"]
    assert {p.alpha for m, p in unet.items() if m.endswith("to_q")} == {1.0}
    assert {p.alpha for m, p in unet.items() if not m.endswith("to_q")} == {2.0 * RANK}
    mine = pipeline.generate([request({"M": 0.5})])[0]
    reference = theirs(
        folders["sd15"], "sd15", {"M": path}, {"M": 0.5}, pipeline.resolve(request({"M": 0.5}))
    )
    assert float(np.abs(mine - reference).max()) < TOLERANCE


def test_lora_settings_gather_flags_and_a_folder_and_refuse_clashes(loras, tmp_path) -> None:
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "detail.safetensors").write_bytes(loras["sd15"]["B"].read_bytes())
    settings = Settings(lora=[f"style={loras['sd15']['A']}"], lora_dir=folder)
    assert settings.adapters == {"style": loras["sd15"]["A"], "detail": folder / "detail.safetensors"}
    from_env = Settings(lora=f"a={loras['sd15']['A']},b={loras['sd15']['B']}")  # DIFFSHARD_LORA's form
    assert list(from_env.adapters) == ["a", "b"]
    with pytest.raises(ConfigError, match="two adapters are named 'detail'"):
        _ = Settings(lora=[f"detail={loras['sd15']['A']}"], lora_dir=folder).adapters
    with pytest.raises(ValueError, match="NAME=PATH"):
        Settings(lora=["no-equals-sign"])


def test_rslora_adapters_scale_by_the_square_root_of_the_rank_as_peft(folders, loras, tmp_path) -> None:
    """peft's `use_rslora` in the file's metadata: scaling alpha / √rank, not alpha / rank."""
    tensors = load_file(loras["sd15"]["A"])
    parts = {
        part: {k.removeprefix(f"{part}."): v for k, v in tensors.items() if k.startswith(f"{part}.")}
        for part in ("unet", "text_encoder")
    }
    config = {"r": RANK, "lora_alpha": 2 * RANK, "use_rslora": True}
    StableDiffusionPipeline.save_lora_weights(
        tmp_path,
        unet_lora_layers=parts["unet"],
        text_encoder_lora_layers=parts["text_encoder"],
        weight_name="rslora.safetensors",
        unet_lora_adapter_metadata={**config, "target_modules": list(UNET_TARGETS)},
        text_encoder_lora_adapter_metadata={**config, "target_modules": list(TEXT_TARGETS)},
    )
    path = tmp_path / "rslora.safetensors"
    pipeline = ours(folders["sd15"], "sd15", {"R": path}, devices="cpu")
    pairs = [p for part in pipeline.adapters.loaded["R"].parts.values() for p in part.values()]
    assert {p.scaling for p in pairs} == {2 * RANK / RANK**0.5}  # 4, where alpha / rank is 2
    mine = pipeline.generate([request({"R": 0.5})])[0]
    reference = theirs(
        folders["sd15"], "sd15", {"R": path}, {"R": 0.5}, pipeline.resolve(request({"R": 0.5}))
    )
    assert float(np.abs(mine - reference).max()) < TOLERANCE


FLUX_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "proj_out")


def test_flux_files_with_alpha_keys_load_at_the_strength_flux_pipeline_gives(tmp_path, flux_folder) -> None:
    """A FLUX LoRA as trainers write it (`<module>.alpha` beside each pair): diffusers reads the
    alphas only with `return_alphas=True`; here alpha ≠ rank, and differs between modules."""
    folder = flux_folder
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    generator = torch.Generator().manual_seed(11)
    tensors: dict[str, torch.Tensor] = {}
    parts = (
        ("transformer", pipe.transformer, FLUX_TARGETS),
        ("text_encoder", pipe.text_encoder, TEXT_TARGETS),
    )
    for part, name, _ in random_pairs(parts, generator, RANK, tensors):
        alpha = 1.0 if name.endswith("to_q") else 2.0 * RANK
        tensors[f"{part}.{name}.alpha"] = torch.tensor(alpha)
    path = tmp_path / "flux-lora.safetensors"
    save_file(tensors, path)
    pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    pipeline.add_adapter(read_adapter("F", path, pipeline.family))
    adapter = pipeline.adapters.loaded["F"]
    assert sorted(adapter.parts) == ["text_encoder", "transformer"]
    alphas = {m: p.alpha for pairs in adapter.parts.values() for m, p in pairs.items()}
    assert len(alphas) == len(tensors) // 3  # every pair, each with its own alpha
    assert {a for m, a in alphas.items() if m.endswith("to_q")} == {1.0}
    assert {a for m, a in alphas.items() if not m.endswith("to_q")} == {2.0 * RANK}
    asked = GenerationRequest(
        "a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32, lora=(("F", 0.8),)
    )
    mine = pipeline.generate([asked])[0]
    base = pipeline.generate([dataclasses.replace(asked, lora=())])[0]
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path), weight_name=path.name, adapter_name="F")
    pipe.set_adapters(["F"], [0.8])
    reference = diffusers_image(pipe, pipeline.resolve(asked))
    assert float(np.abs(mine - reference).max()) < TOLERANCE
    assert float(np.abs(mine - base).max()) > 20 * TOLERANCE


def test_a_call_whose_rows_do_not_match_its_plan_raises_instead_of_skipping_adapters(folders, loras) -> None:
    pipeline = ours(folders["sd15"], "sd15", {"A": loras["sd15"]["A"]}, devices="cpu")
    tokens = pipeline.components.tokenizers[0](
        ["a red circle"] * 2, padding="max_length", return_tensors="pt"
    )
    encoder, slot = pipeline.encoders[0], pipeline.encoder_slots[0]
    slot.rows = AdapterRows(((("A", 1.0),),) * 2)
    with torch.inference_mode():
        encoder(tokens.input_ids)  # the slot's rows: fine
    slot.rows = AdapterRows(((("A", 1.0),),) * 3)
    with torch.inference_mode(), pytest.raises(RowsMismatch, match="2 rows"):
        encoder(tokens.input_ids)
    slot.rows = None


def test_an_adapter_removed_leaves_the_base_model_bit_for_bit(folders, loras) -> None:
    plain = Pipeline.load(folders["sd15"], devices="cpu").generate([request({})])[0]
    pipeline = ours(folders["sd15"], "sd15", loras["sd15"], devices="cpu")
    styled = pipeline.generate([request({"B": 1.0})])[0]
    pipeline.adapters.remove("A")
    assert pipeline.generate([request({"B": 1.0})])[0].tolist() == styled.tolist()  # B as it was
    pipeline.adapters.remove("B")
    assert not any(m._forward_hooks for e in pipeline.encoders if e is not None for m in e.modules())
    np.testing.assert_array_equal(pipeline.generate([request({})])[0], plain)
