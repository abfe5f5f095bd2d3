"""Command line: `python -m server serve ...` runs the HTTP service; `python -m server plan ...`
prints how a model's denoiser would be split across devices. Both take their shared options
(devices, strategy, budgets, dtype, batch, pixels) from the one settings class, with the same
defaults, so the plan `plan` prints is the plan `serve` runs."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import json
import logging
import os
import socket
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from wsgiref.simple_server import WSGIServer

import uvicorn
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from server.api.connections import bounded_protocol
from server.api.metricsport import ProbeTarget, start_metrics_port
from server.api.requestid import QueryRedaction, RequestIdFilter
from server.app import create_app
from server.engine import Costs, Strategy
from server.engine.hardware.devices import format_bytes, planning_absent_devices
from server.engine.hardware.memory import bound_kernel_cache
from server.engine.hardware.simulated import install_from_environment
from server.errors import ConfigError, Draining, PlanError
from server.pipeline.families import reference_family, reference_names
from server.pipeline.loading.folder import quiet_libraries, read_family
from server.pipeline.loading.model_plan import compare_costs, fits_by_mode, largest_side
from server.pipeline.loading.quantized_parts import describe
from server.serving import Runtime
from server.settings import CONCERNS, ServerSettings, Settings
from server.settings.values import is_loopback
from server.startup import check_runs_here, decide_dtype, decoder_for, fitted_plan, pixel_limit, served_dtype

log = logging.getLogger("diffshard")

PLAN_SETTINGS = (
    "devices",
    "strategy",
    "parallel",
    "layout",
    "max_memory",
    "dtype",
    "max_batch",
    "max_pixels",
    "threads",
    "costs",
    "device_profile",
    "cache_dir",
    "quantize",
    "denoiser_file",
    "vae_tiling",
    "controlnet",
    "controlnet_dir",
)


def _add_setting(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str) -> None:
    """A flag for a settings field: its description, environment variable and default."""
    info = Settings.model_fields[name]
    default = "the built-in model" if name == "model" else info.default
    default = getattr(default, "value", default)  # enums print as their value
    flag, env = f"--{name.replace('_', '-')}", f"env DIFFSHARD_{name.upper()}"
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if extra.get("env_only"):  # a secret: a flag would show it in the process list
        return
    if extra.get("repeatable"):
        metavar = str(extra.get("metavar", "NAME=PATH"))
        parser.add_argument(
            flag, dest=name, action="append", metavar=metavar, help=f"{info.description} ({env})"
        )
        return
    if info.annotation is bool:
        parser.add_argument(
            flag, dest=name, action="store_const", const=True, help=f"{info.description} ({env})"
        )
        return
    help_text = f"{info.description} ({env}; default: {default})".replace("%", "%%")  # argparse formats it
    metavar = name.removesuffix("_s").split("_")[-1].upper()
    parser.add_argument(flag, dest=name, metavar=metavar, help=help_text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service (OpenAI Images API) under uvicorn")
    for concern in CONCERNS:  # every setting is a flag, under its concern's heading
        group = serve.add_argument_group(concern.title)
        for name in concern.model_fields:
            _add_setting(group, name)

    plan = commands.add_parser("plan", help="plan a shard split and print it; loads no weights")
    model = plan.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="a diffusers pipeline folder (default: the built-in model)")
    model.add_argument("--config", choices=reference_names(), help="a well-known architecture instead")
    for name in PLAN_SETTINGS:
        _add_setting(plan, name)
    plan.add_argument(
        "--device-map",
        help="the explicit strategy's block=device,... or a JSON file of them (--strategy explicit)",
    )
    plan.add_argument(
        "--resolution",
        type=int,
        help="image side in pixels the reserve is sized for (default: the largest allowed)",
    )
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


def _settings(args: argparse.Namespace, **overrides: object) -> Settings:
    """Flags over environment over defaults, validated; errors name the flag and its variable."""
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        return Settings(**{name: value for name, value in given.items() if value is not None} | overrides)
    except ValidationError as err:
        problems = []
        for error in err.errors():
            message = error["msg"].removeprefix("Value error, ")
            if not error["loc"]:  # a check across concerns: its message names the flags
                problems.append(message)
                continue
            name = str(error["loc"][0])
            problems.append(f"--{name.replace('_', '-')} (DIFFSHARD_{name.upper()}): {message}")
        raise ConfigError("; ".join(problems)) from None


def plan_command(args: argparse.Namespace) -> None:
    with planning_absent_devices():  # on the meta device: GPUs this host lacks may be planned for
        _plan(args)


def _plan(args: argparse.Namespace) -> None:
    explicit = args.strategy == Strategy.EXPLICIT
    if args.device_map and not explicit:
        raise PlanError("--device-map is the explicit strategy's map: add --strategy explicit")
    settings = _settings(args, **({"strategy": Strategy.MEMORY} if explicit else {}))
    family = reference_family(args.config) if args.config else read_family(settings.model)
    settings = decide_dtype(settings, family)  # auto: measured here, once; the plan prints what it chose
    options: dict = (
        {"strategy": Strategy.EXPLICIT, "device_map": _device_map(args.device_map)} if explicit else {}
    )
    if args.resolution is not None:
        if args.resolution <= 0 or args.resolution % family.size_multiple:
            raise PlanError(
                f"--resolution must be a positive multiple of {family.size_multiple}, got {args.resolution}"
            )
        options["side"] = args.resolution
    options["device_profile"] = settings.device_profile  # serving has every device: only plans use it
    folder = None if args.config else settings.model
    settings, plan = fitted_plan(settings, family, folder=folder, **options)
    decoder = decoder_for(settings, family, plan, options.get("side"))
    modes = None
    if args.quantize is not None:  # asked about quantizing: how each mode fits, beside the plan
        side = options.get("side") or largest_side(family, pixel_limit(settings, family))
        modes = fits_by_mode(
            family,
            settings.devices,
            dtype=served_dtype(settings),
            batch=settings.max_batch,
            side=side,
            max_memory=settings.max_memory,
            folder=folder,
        )
    side_by_side = None
    if settings.costs == Costs.MEASURED:  # what counting would have predicted, beside the timings
        device = plan.replicas[0].stages[0].device
        side_by_side = compare_costs(
            family, device, served_dtype(settings), plan.threads or 1, settings.cache_dir
        )
    if args.json:
        extra: dict = {"vae_decoder": decoder.to_dict()}
        if side_by_side:
            extra["block_costs"] = side_by_side
        if modes:
            extra["quantize"] = {"mode": describe(settings.quantize, settings.denoiser_file), "modes": modes}
        print(json.dumps(plan.to_dict() | extra, indent=2))
        return
    print(plan)
    print(decoder)
    if modes:
        print(f"\n--quantize MODE alone, a memory-balanced split over {', '.join(settings.devices)}:")
        for mode, fit in modes.items():
            sizes = (
                f"denoiser {format_bytes(fit['denoiser_bytes'])}, others {format_bytes(fit['other_bytes'])}"
            )
            verdict = f"fits on {', '.join(fit['stages'])}" if fit["fits"] else str(fit["why"])
            print(f"  {mode:13} {sizes}: {verdict}")
    if side_by_side:
        threads = plan.threads or 1
        print(f"\nseconds per block on one {device} worker ({threads} thread(s)), counted vs measured:")
        for block, both in side_by_side.items():
            counted, measured = both["counted_s"], both["measured_s"]
            print(
                f"  {block:24} {counted * 1e3:10.2f} ms {measured * 1e3:10.2f} ms  {counted / measured:5.2f}×"
            )


# uvicorn's graceful shutdown after the drain: the responses already computed go out. A pod's
# terminationGracePeriodSeconds must cover preStop + drain timeout + this (tests/deploy checks).
SHUTDOWN_GRACE_S = 5


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on SIGTERM (or Ctrl+C): /readyz and new requests get 503
    while the listening socket stays open, in-flight requests finish (up to the drain timeout),
    then the server exits 0. A second signal answers what is still in flight 503 and stops at
    once, without tracebacks (uvicorn would re-raise it as a KeyboardInterrupt)."""

    def __init__(
        self, config: uvicorn.Config, runtime: Runtime, drain_timeout_s: float, probes: ProbeTarget
    ) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self.probes = probes

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.probes.loop = asyncio.get_running_loop()  # the metrics port's /livez asks it to answer
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining:
            log.warning("second signal: answering the requests in flight 503 and stopping now")
            if self.runtime.service is not None:
                self.runtime.service.abandon(Draining("the server was stopped before this request finished"))
            self.should_exit = True
            return
        self.draining = True
        threading.Thread(target=self._drain, name="diffshard-drain", daemon=True).start()

    def _drain(self) -> None:
        timeout = self.drain_timeout_s
        log.info("draining: refusing new requests, waiting up to %g s for those in flight", timeout)
        if not self.runtime.drain(timeout):
            log.warning("drain timeout: the requests still in flight are answered 503")
            if self.runtime.service is not None:
                self.runtime.service.close()  # their clients still listen: answer them now
        self.should_exit = True


def serve_command(args: argparse.Namespace) -> int:
    """Validate, take both ports, plan, then serve; the model loads once uvicorn runs. Exit 0 after
    a drain, 1 if the model failed to load (the cause is the last line)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())  # lines about a request end with its id
    logging.captureWarnings(True)  # a library's warnings.warn in the log's format, its source named
    quiet_libraries()
    settings = _settings(args)
    logging.getLogger("uvicorn.access").addFilter(QueryRedaction())  # a key sent in a query stays out
    _refuse_remote_fault_injection(settings)
    check_runs_here(settings)  # float8 on a CPU, --compile-route aot without it...: one line, now
    bound_kernel_cache()  # before planning times a convolution
    # Both ports are taken before anything loads: a busy port fails in a second, with one line,
    # rather than after the model loaded (or, for the metrics port, with a traceback).
    api_socket = bind_port(settings.host, settings.port, "port")
    registry, probes = CollectorRegistry(), ProbeTarget()
    exporter = serve_metrics(ServerSettings.of(settings), registry, probes) if settings.metrics_port else None
    try:
        family = read_family(settings.model)
        settings = decide_dtype(settings, family)  # --dtype auto, on a CPU: measured (cached), once
        # Plan once, on the meta device: a split that cannot fit fails here, before any weight
        # loads; the server then loads the model with this very plan.
        settings, plan = fitted_plan(settings, family, folder=settings.model)
        log.info("%s", plan.headline)
        log.info("%s", decoder_for(settings, family, plan))
        server: DrainingServer | None = None

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        app = create_app(settings, plan, registry=registry, on_fatal=stop, serve_metrics=False)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            http=bounded_protocol(settings.read_timeout_s, settings.max_connections),
        )
        runtime: Runtime = app.state.runtime
        probes.runtime = runtime
        server = DrainingServer(config, runtime, settings.drain_timeout_s, probes)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        log.info("listening on http://%s:%d; loading %s", host, settings.port, settings.served_name)
        server.run(sockets=[api_socket])
    finally:
        api_socket.close()
        if exporter is not None:
            exporter.shutdown()
    if runtime.status == "failed":  # the cause was logged; it is also the last line
        print(
            f"error: cannot serve {settings.model}: {_one_line(runtime.error or 'the load failed')}",
            file=sys.stderr,
        )
        return 1
    return 0 if server.started else 1


def bind_port(host: str, port: int, setting: str) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it); ConfigError naming the setting."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise ConfigError(f"--host (DIFFSHARD_HOST): cannot resolve {host!r}: {err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise _port_error(setting, host, port, err) from None
    sock.set_inheritable(True)
    return sock


def serve_metrics(settings: ServerSettings, registry: CollectorRegistry, probes: ProbeTarget) -> WSGIServer:
    """The metrics port: `registry` (empty until the app fills it) and the probes (api/metricsport.py)."""
    try:
        exporter = start_metrics_port(settings.host, settings.metrics_port, registry, probes)
    except OSError as err:
        raise _port_error("metrics_port", settings.host, settings.metrics_port, err) from None
    log.info(
        "metrics and probes (/livez, /readyz) on http://%s:%d/metrics", settings.host, settings.metrics_port
    )
    return exporter


def _port_error(setting: str, host: str, port: int, err: OSError) -> ConfigError:
    flag, env = f"--{setting.replace('_', '-')}", f"DIFFSHARD_{setting.upper()}"
    reason = "is in use" if err.errno == errno.EADDRINUSE else f"cannot be bound ({err.strerror})"
    return ConfigError(
        f"{flag} ({env}): port {port} on {host} {reason}; stop what holds it or choose another port"
    )


def _refuse_remote_fault_injection(settings: Settings) -> None:
    """Fault injection lets any client fail steps on purpose: only on a loopback address."""
    if settings.inject_faults and not is_loopback(settings.host):
        raise ConfigError(
            f"--inject-faults (DIFFSHARD_INJECT_FAULTS) is for tests: refused with --host {settings.host}; "
            "listen on a loopback address (127.0.0.1, ::1, localhost) or unset it"
        )


def _one_line(text: str) -> str:
    """An error as one line: the last line of output is the one operators and tests read."""
    return " ".join(text.split())


def _debug(args: argparse.Namespace) -> bool:
    """--debug or DIFFSHARD_DEBUG, read even when the settings themselves did not validate."""
    if getattr(args, "debug", None):
        return True
    return os.environ.get("DIFFSHARD_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    """Every failure ends with one line naming its cause (exit 2: a setting, a folder or a port to
    fix; 1: anything else); the traceback comes before it only with --debug."""
    args = _parser().parse_args(argv)
    try:
        install_from_environment(os.environ)  # DIFFSHARD_SIMULATED_GPUS: a multi-GPU plan tried on a CPU
        if args.command == "serve":
            return serve_command(args)
        plan_command(args)
    except (ValueError, FileNotFoundError) as err:  # ConfigErrors (plan, device, folder) are ValueErrors
        if _debug(args):
            traceback.print_exc()
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:
        if _debug(args):
            traceback.print_exc()
        print(f"error: {type(err).__name__}: {_one_line(str(err))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    gc.freeze()  # nothing made is garbage now: exit skips the sweep of every object (~2 s)
    sys.exit(code)
