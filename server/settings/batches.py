"""The Batch API: the files a batch reads and writes (`/v1/files`), its lines and their store
(the job store's, `--job-store`), and the bounds that keep a batch from crowding out the rest.
What the batch store and the batch runner are built from."""

from __future__ import annotations

from pydantic import Field

from server.settings.values import Concern

DAY_S = 86400


class BatchSettings(Concern):
    title = "the Batch API: its files, lines and bounds"

    batch_file_bytes: int = Field(
        64 * 2**20, ge=1024, description="bytes of one file uploaded to /v1/files (a batch's JSONL input)"
    )
    batch_line_bytes: int = Field(
        16 * 2**20,
        ge=1024,
        description="bytes of one line of a batch's input (an edit's images in base64 count)",
    )
    batch_max_lines: int = Field(10000, ge=1, le=1_000_000, description="requests (lines) in one batch")
    batch_max_per_key: int = Field(
        16, ge=1, description="batches of one API key unfinished at once (another one is refused: 429)"
    )
    batch_store_bytes: int = Field(
        10 * 1024**3,
        ge=1,
        description="the files kept (inputs, outputs, errors) in all; past it the first to expire go",
    )
    batch_file_expiry_s: int = Field(
        30 * DAY_S, ge=60, description="seconds a file (a batch's input, output or errors) is kept"
    )
    batch_window_s: int = Field(
        DAY_S,
        ge=1,
        description="seconds a batch's completion window ('24h', the one OpenAI takes) lasts here: lines "
        "left at its end expire",
    )
    batch_rows_in_flight: int | None = Field(
        None,
        ge=1,
        description="denoiser rows of batch lines a replica runs at once, beside interactive requests "
        "(default: 2 x --max-batch)",
    )
    batch_lease_s: float = Field(
        30, ge=1, le=3600, description="seconds a running batch line's lease lasts unrenewed"
    )
