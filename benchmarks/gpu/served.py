"""The GPU check's serve phase: `python -m server serve` on the device through real uvicorn, with
the tiny SD-1.5 folder the tests build; one image asked over HTTP, then /v1/shards and /metrics
read, and the device's memory series checked to be there."""

from __future__ import annotations

import base64
import gc
import io
import re
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image

from benchmarks.gpu import Lines, phase_parser
from tests.support.live import free_port, live_server
from tests.support.tiny_pipelines import build_sd15_folder

REQUEST = {"prompt": "a red circle", "size": "64x64", "n": 2, "num_inference_steps": 4, "seed": 1}
DEVICE_SERIES = ("diffshard_device_total_bytes", "diffshard_shard_parameter_bytes")
CUDA_SERIES = (
    "diffshard_device_allocated_bytes",
    "diffshard_device_reserved_bytes",
)  # the caching allocator's


def main() -> None:
    args = phase_parser(__doc__).parse_args()
    lines = Lines(args.lines)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_sd15_folder(Path(tmp) / "sd15")
        started = time.monotonic()
        flags = ("--model", str(folder), "--devices", device, "--metrics-port", str(free_port()))
        with live_server(*flags) as server:
            ready_s = time.monotonic() - started
            asked = time.monotonic()
            response = httpx.post(f"{server.url}/v1/images/generations", json=REQUEST, timeout=120)
            answered_s = time.monotonic() - asked
            response.raise_for_status()
            images = [
                Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response.json()["data"]
            ]
            shards = httpx.get(f"{server.url}/v1/shards", timeout=30).json()
            assert server.metrics_url is not None
            exposition = httpx.get(server.metrics_url, timeout=30).text
    series = {
        name: [line for line in exposition.splitlines() if line.startswith(name + "{") and device in line]
        for name in DEVICE_SERIES + (CUDA_SERIES if device.startswith("cuda") else ())
    }

    def mib(name: str) -> str:
        values = [float(line.rsplit(" ", 1)[1]) / 2**20 for line in series.get(name, ())]
        return f"{max(values):.0f} MiB" if values else "n/a"

    lines.write(
        {
            "device": device,
            "ready_s": round(ready_s, 1),
            "request_s": round(answered_s, 2),
            "status": response.status_code,
            "images": [f"{image.width}x{image.height} {image.mode}" for image in images],
            "shards": shards,
            "metrics_series": {name: found[:2] for name, found in series.items()},
        }
    )
    missing = [name for name, found in series.items() if not found]
    answered = re.search(r'^diffshard_http_requests_total\{[^}]*code="200"[^}]*\} (\S+)', exposition, re.M)
    lines.write(
        {
            "headline": f"HTTP {response.status_code} {len(images)} images in {answered_s:.2f} s "
            f"(ready {ready_s:.0f} s) on {device}: weights {mib('diffshard_shard_parameter_bytes')}, "
            f"allocated {mib('diffshard_device_allocated_bytes')}"
            + (f"; MISSING {', '.join(missing)}" if missing else "")
            + ("" if answered else "; no 200 counted in diffshard_http_requests_total")
        }
    )
    if missing or len(images) != REQUEST["n"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
