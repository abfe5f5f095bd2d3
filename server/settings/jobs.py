"""Video jobs: the store they live in (surviving restarts, shared by replicas), their leases,
how long their content stays, how many a replica runs at once. What the job store and the
video runner are built from."""

from __future__ import annotations

from pydantic import Field

from server.serving.videos import RUNNING_VIDEOS
from server.serving.videostore import default_job_store
from server.settings.values import Concern, JobStoreURL


class JobSettings(Concern):
    title = "video jobs and their store"

    job_store: JobStoreURL = Field(
        default_factory=default_job_store,
        description="where video jobs live, surviving restarts: sqlite:///PATH (one server; default: "
        "under $XDG_DATA_HOME/diffshard) or redis://HOST:PORT/DB (replicas share it)",
    )
    video_lease_s: float = Field(
        30, ge=1, le=3600, description="seconds a running video job's lease lasts unrenewed (Redis store)"
    )
    video_fps: int | None = Field(
        None,
        ge=1,
        le=120,
        description="frames a second of the videos made; default: the model's (Wan: 16, LTX-2: 24)",
    )
    video_expiry_s: int = Field(86400, ge=60, description="seconds a finished video stays downloadable")
    video_store_bytes: int = Field(
        10 * 1024**3, ge=1, description="the finished videos' content in all; past it the oldest go"
    )
    max_running_videos: int = Field(
        RUNNING_VIDEOS,
        ge=1,
        le=64,
        description="video jobs a replica runs at once, their steps batched by the step loop (each one "
        "claimed is held from the store's other replicas)",
    )
