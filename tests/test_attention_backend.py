"""The attention backend chosen by measurement (`--attention`, engine/runtime/sdpa_backend.py):
the chooser times real SDPA calls on whatever device it is given (here the CPU, where flash and
math run and efficient and cuDNN raise "No available kernel"), refuses a named backend that cannot
run, puts its choice first in PyTorch's process-wide order with every backend still enabled, and
/v1/stats shows it. Which backend a GPU should take is measured on the GPU, never asserted here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from server.app import create_app, load_service
from server.engine.hardware import simulated
from server.engine.runtime.cpu_attention import Recording, Shape
from server.engine.runtime.sdpa_backend import (
    MEASURED,
    TOP_SHAPES,
    AttentionSetting,
    Measured,
    choose,
    fastest,
    priority_names,
    put_first,
    restore,
)
from server.errors import ConfigError
from server.pipeline import Pipeline
from server.pipeline.loading.attention_calls import attention_calls, serve_attention
from server.settings import Settings

FLAGS = ("flash", "mem_efficient", "math", "cudnn")


def shape(batch: int, heads: int, tokens: int, dim: int, keys: int | None = None) -> Shape:
    kv = (batch, heads, keys or tokens, dim)
    return Shape((batch, heads, tokens, dim), kv, kv, torch.float32)


def enabled() -> dict[str, bool]:
    return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in FLAGS}


@pytest.fixture(autouse=True)
def sdpa_state() -> Iterator[None]:
    """PyTorch's SDPA order and flags are the process's: each test leaves them as it found them."""
    order, flags = torch._C._get_sdp_priority_order(), enabled()
    yield
    restore(order)
    for name, on in flags.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def test_the_chooser_times_each_backend_that_runs_and_marks_the_others_unable() -> None:
    calls = {
        shape(1, 2, 32, 16): 6,
        shape(1, 2, 32, 16, keys=8): 6,
        shape(1, 1, 16, 8): 2,
        shape(1, 1, 8, 8): 1,
    }
    choice = choose("auto", {"cpu": calls})
    (measured,) = choice.measured
    assert set(measured.ms) == set(MEASURED)
    assert measured.ms["default"] > 0 and measured.ms["flash"] > 0  # the CPU's kernels
    assert measured.ms["efficient"] is None and measured.ms["cudnn"] is None  # "No available kernel"
    assert choice.backend in ("default", "flash")
    assert len(measured.shapes) == TOP_SHAPES and shape(1, 1, 8, 8) not in dict(measured.shapes)  # the rarest
    assert dict(measured.shapes)[shape(1, 2, 32, 16)] == 6 and 1 <= measured.rounds <= 5
    assert enabled() == dict.fromkeys(FLAGS, True)  # forcing a backend ended with its timing
    view = choice.view()
    assert view["setting"] == "auto" and view["devices"]["cpu"]["ms"]["cudnn"] is None
    assert view["devices"]["cpu"]["shapes"][0] == {
        "query": [1, 2, 32, 16],
        "key": [1, 2, 32, 16],
        "dtype": "float32",
        "calls": 6,
    }


def test_another_backend_is_taken_only_when_faster_than_pytorchs_own_by_the_margin() -> None:
    def on(device: str, **ms: float | None) -> Measured:
        return Measured(
            device, {"default": 100.0, "cudnn": None, "flash": None, "efficient": None} | ms, (), 1
        )

    assert fastest([on("cuda:0", cudnn=98.0)]) == "default"  # 2%: noise keeps PyTorch's choice
    assert fastest([on("cuda:0", cudnn=80.0, flash=90.0)]) == "cudnn"
    # over devices: the lowest total of those every device runs
    assert fastest([on("cuda:0", cudnn=50.0, flash=90.0), on("cuda:1", flash=90.0)]) == "flash"
    assert fastest([on("cuda:0", default=None, flash=1.0)]) == "default"  # nothing to compare with
    assert fastest([]) == "default"


def test_a_named_backend_that_cannot_run_here_stops_the_start_naming_those_that_can() -> None:
    calls = {"cpu": {shape(1, 2, 16, 8): 3}}
    refused = r"^--attention efficient: PyTorch cannot run it on cpu for the denoiser's attention "
    refused += r"\(\[1, 2, 16, 8\] over 16 keys\): pick auto, default, flash \(DIFFSHARD_ATTENTION\)$"
    with pytest.raises(ConfigError, match=refused):
        choose("efficient", calls)
    with pytest.raises(ConfigError, match="runs on no CUDA device: use --attention auto or default"):
        choose("cudnn", {})  # the denoiser only on CPUs: nothing it could order
    named = choose("flash", calls)  # runs here: taken, with its figures beside PyTorch's own
    assert named.backend == "flash" and set(named.measured[0].ms) == {"default", "flash"}
    assert choose("default", calls).measured == ()  # nothing timed
    assert choose("auto", {}, cpu=True).view() == {"cpu": "as compiled graphs choose"}


def test_the_choice_goes_first_in_pytorchs_order_with_every_backend_still_enabled() -> None:
    before = tuple(torch._C._get_sdp_priority_order())
    assert put_first("default") == before and tuple(torch._C._get_sdp_priority_order()) == before
    assert put_first("cudnn") == before
    order = torch._C._get_sdp_priority_order()
    assert order[0] == int(SDPBackend.CUDNN_ATTENTION) and sorted(order) == sorted(before)
    assert priority_names()[0] == "cudnn" and enabled() == dict.fromkeys(FLAGS, True)
    q = torch.randn(1, 2, 16, 8)  # a call cuDNN cannot run falls to the next backend: it never fails
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), (q @ q.mT / 8**0.5).softmax(-1) @ q)
    restore(before)
    assert tuple(torch._C._get_sdp_priority_order()) == before


def test_a_simulated_gpu_is_measured_with_the_cpus_kernels_and_its_calls_counted_per_device() -> None:
    with simulated.simulate(2):
        pipeline = Pipeline.load(devices="cuda:0,cuda:1", strategy="even")
        calls = attention_calls(pipeline, ["cuda:0", "cuda:1"])
        # the built-in UNet's halves: each device its own blocks' calls, a guided request's 2 rows
        assert calls["cuda:0"] and calls["cuda:1"] and calls["cuda:0"] != calls["cuda:1"]
        assert all(s.query[0] == 2 and s.dtype == pipeline.denoiser_dtype for c in calls.values() for s in c)
        choice = serve_attention(AttentionSetting.AUTO, pipeline)
    assert {m.device for m in choice.measured} == {"cuda:0", "cuda:1"}
    for measured in choice.measured:  # its tensors run CPU kernels: efficient and cuDNN cannot
        assert measured.ms["flash"] is not None and measured.ms["efficient"] is None
    assert "cpu" not in choice.view() and choice.view()["order"][0] in ("flash", choice.backend)


def test_stats_show_the_attention_of_a_service_loaded_on_cpus() -> None:
    settings = Settings(devices="cpu")
    app = create_app(settings)
    runtime = app.state.runtime
    runtime.service = load_service(settings, compiling=runtime.compiling)
    runtime.status = "ready"
    try:
        stats = _get(app, "/v1/stats")
    finally:
        runtime.service.close()
    assert stats.status_code == 200 and stats.json()["attention"] == {"cpu": "as compiled graphs choose"}
    assert stats.json()["dtype"] == {"dtype": "float32", "reason": "--dtype"}  # named (conftest.py)


def _get(app, path: str) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # no lifespan: the service is the test's
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get(path)

    return asyncio.run(call())


def test_the_setting_takes_the_backends_by_name_and_a_cpu_service_refuses_a_named_one() -> None:
    assert Settings(attention="cudnn").attention == AttentionSetting.CUDNN
    with pytest.raises(ValueError, match="'auto', 'default', 'cudnn', 'flash', 'efficient' or 'math'"):
        Settings(attention="fastest")
    pipeline = Pipeline.load(devices="cpu")
    assert serve_attention("auto", pipeline).view() == {"cpu": "as compiled graphs choose"}
    with pytest.raises(ConfigError, match=r"^--attention flash orders PyTorch's CUDA attention backends"):
        serve_attention("flash", pipeline)


def test_calls_naming_their_tensors_are_counted_for_timing_and_cpu_routing_reads_them_as_before() -> None:
    q = torch.randn(1, 2, 8, 4)
    counting = Recording(device=None, keywords=True)
    with counting:
        F.scaled_dot_product_attention(query=q, key=q, value=q, attn_mask=None, scale=None)
        F.scaled_dot_product_attention(q, key=q, value=q)
    assert counting.calls == {Shape((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), torch.float32): 2}
    with pytest.raises(ValueError), Recording():  # frozen CPU graphs' reading, unchanged
        F.scaled_dot_product_attention(query=q, key=q, value=q)


def test_a_flux_denoisers_calls_at_its_default_size_are_counted(flux_folder) -> None:
    pipeline = Pipeline.load(flux_folder, devices="cpu")
    (calls,) = attention_calls(pipeline, ["cpu"]).values()
    blocks = len(pipeline.shard.model.transformer_blocks) + len(
        pipeline.shard.model.single_transformer_blocks
    )
    assert sum(calls.values()) == blocks and all(s.query[0] == 1 for s in calls)  # guidance-distilled: 1 row
