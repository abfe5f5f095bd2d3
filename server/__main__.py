"""Command line: `python -m server serve ...` runs the HTTP service; `python -m server plan ...`
prints how a UNet would be split across devices."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path
from types import FrameType

import uvicorn
from pydantic import ValidationError

from server.app import Runtime, create_app
from server.architectures import UNET_CONFIGS, VAE_SCALE_FACTOR, meta_unet, meta_unet_from_folder
from server.config import DTYPES, Settings
from server.engine import PlanError, plan_shards
from server.engine.plan import STRATEGIES

log = logging.getLogger("diffshard")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service (OpenAI Images API) under uvicorn")
    # every setting is a flag: the settings class is the one list of them
    for name, info in Settings.model_fields.items():
        default = "the built-in model" if name == "model" else info.default
        flag, env = f"--{name.replace('_', '-')}", f"env DIFFSHARD_{name.upper()}"
        if info.annotation is bool:
            help_text = f"{info.description} ({env})"
            serve.add_argument(flag, dest=name, action="store_const", const=True, help=help_text)
        else:
            help_text = f"{info.description} ({env}; default: {default})"
            metavar = name.removesuffix("_s").split("_")[-1].upper()
            serve.add_argument(flag, dest=name, metavar=metavar, help=help_text)

    plan = commands.add_parser("plan", help="plan a shard split and print it; loads no weights")
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="a diffusers pipeline folder (or its unet/)")
    model.add_argument("--config", choices=sorted(UNET_CONFIGS), help="a well-known architecture")
    plan.add_argument("--devices", default="auto", help="auto | cpu,cpu | cuda:0,cuda:1 (default: auto)")
    plan.add_argument("--strategy", choices=STRATEGIES, default="even")
    plan.add_argument("--max-memory", help="per-device budgets, e.g. cuda:0=20GiB,cpu=64GiB")
    plan.add_argument("--device-map", help="explicit strategy: block=device,... or a JSON file of them")
    plan.add_argument("--resolution", type=int, help="image side in pixels (default: the model's native)")
    plan.add_argument("--batch", type=int, default=2, help="UNet batch, CFG rows included (default: 2)")
    plan.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _device_map(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    if Path(text).is_file():
        return json.loads(Path(text).read_text())
    pairs = [part.split("=", 1) for part in text.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise PlanError(f"bad --device-map {text!r}: write block=device,... e.g. embed=cuda:0,conv_in=cuda:0")
    return {block.strip(): device.strip() for block, device in pairs}


def plan_command(args: argparse.Namespace) -> None:
    if args.model:
        unet, scale = meta_unet_from_folder(args.model)
    else:
        unet, scale = meta_unet(args.config), VAE_SCALE_FACTOR
    if args.resolution is not None and (args.resolution <= 0 or args.resolution % scale):
        raise PlanError(f"--resolution must be a positive multiple of {scale}, got {args.resolution}")
    plan = plan_shards(
        unet,
        args.devices,
        args.strategy,
        max_memory=args.max_memory,
        device_map=_device_map(args.device_map),
        dtype=DTYPES[args.dtype],
        latent_size=args.resolution // scale if args.resolution else None,
        batch=args.batch,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan)


def _settings(args: argparse.Namespace) -> Settings:
    """Flags over environment over defaults, validated; errors name the flag and its variable."""
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        return Settings(**{name: value for name, value in given.items() if value is not None})
    except ValidationError as err:
        problems = []
        for error in err.errors():
            name = str(error["loc"][0]) if error["loc"] else "settings"
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"--{name.replace('_', '-')} (DIFFSHARD_{name.upper()}): {message}")
        raise ValueError("; ".join(problems)) from None


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on SIGTERM (or Ctrl+C): /readyz and new requests get 503
    while the listening socket stays open, in-flight requests finish (up to the drain timeout),
    then the server exits 0. A second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining:
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self.draining = True
        threading.Thread(target=self._drain, name="diffshard-drain", daemon=True).start()

    def _drain(self) -> None:
        timeout = self.runtime.settings.drain_timeout_s
        log.info("draining: refusing new requests, waiting up to %g s for those in flight", timeout)
        if not self.runtime.drain(timeout):
            log.warning("drain timeout: the requests still in flight are answered 503")
            if self.runtime.engine is not None:
                self.runtime.engine.close()  # their clients still listen: answer them now
        self.should_exit = True


def serve_command(args: argparse.Namespace) -> int:
    settings = _settings(args)
    # Plan on the meta device first: a split that cannot fit fails here, before any weight loads.
    unet, _ = meta_unet_from_folder(settings.model)
    plan_shards(
        unet,
        settings.devices,
        "even" if settings.strategy == "even" else "memory",
        max_memory=settings.max_memory,
        dtype=settings.torch_dtype,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    runtime: Runtime = app.state.runtime
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=5,  # after the drain: responses already computed go out
    )
    server = DrainingServer(config, runtime)

    def stop() -> None:
        server.should_exit = True

    runtime.on_fatal = stop
    server.run()
    return 1 if runtime.status == "failed" or not server.started else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return serve_command(args)
        plan_command(args)
    except (ValueError, FileNotFoundError) as err:  # PlanError and DeviceError are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
