"""How the denoiser is compiled and which attention backend it runs, and the cache folder that
keeps what startup measures and compiles (calibrations, measured costs, compiled graphs) for the
next start."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from server.engine.planning.cache import default_cache_dir
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import CompileRoute
from server.engine.runtime.packages import KEPT_BYTES
from server.engine.runtime.sdpa_backend import AttentionSetting
from server.settings.values import CompileSizes, Concern


class CompileSettings(Concern):
    title = "compiling, attention, and the cache of what startup measures and compiles"

    compile: CompileMode = Field(
        CompileMode.AUTO,
        description="off | full (the whole denoiser, one stage) | blocks (each block: composes with "
        "stages) | auto (full or blocks as the plan allows, each bucket kept where its calls measured "
        "faster than eager); compiled per shape bucket in the background, kept in cache_dir for the "
        "next start",
    )
    compile_sizes: CompileSizes = Field(
        None, description="image sides to compile, e.g. 64,128 (default: the model's default size)"
    )
    compile_budget_s: float = Field(
        1800,
        gt=0,
        description="seconds the background compile may take: once a bucket ends past it, no other is "
        "begun and the calls they would hold run eagerly (a lone image's come first)",
    )
    compile_route: CompileRoute = Field(
        CompileRoute.AUTO,
        description="aot (graphs compiled ahead of time, kept whole in cache_dir: PyTorch 2.13) | jit "
        "(traced at every start, inductor's caches and artifacts kept in cache_dir: any PyTorch) | auto "
        "(aot where this PyTorch has it)",
    )
    attention: AttentionSetting = Field(
        AttentionSetting.AUTO,
        description="PyTorch's attention backend on the denoiser's CUDA devices: auto (each timed on the "
        "served shapes at startup; the fastest first where over 3% faster than default) | default "
        "(PyTorch's order) | cudnn | flash | efficient | math (first; a call it cannot run falls to the "
        "next); CPU devices: unchanged",
    )
    compiled_bytes: int = Field(
        KEPT_BYTES,
        ge=0,
        description="bytes of frozen CPU graphs kept in cache_dir as libraries for the next start (each "
        "holds its model's weights, prepacked: an SD-1.5 UNet's bucket 1.6 GiB); past it the least "
        "recently used go; 0: none kept, frozen again at every start",
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="where calibrations and measured costs are kept ($XDG_CACHE_HOME/diffshard); "
        "unwritable: a warning, and they are timed again",
    )
