"""Benchmarks, grouped by what they measure; run one with `python -m benchmarks.<room>.<name>`
(each prints one JSON object per line, a summary last; `--quick` for a short run). What each
found, with its date and host, is in docs/benchmarks.md.

- `serving/`: a real server over HTTP: throughput and latency (`throughput`), soaks of images
  (`soak`) and video jobs (`video_soak`), memory held and given back (`idle_memory`,
  `host_memory`), admission, fairness and priority (`step_budget`, `fairness`, `deterministic`,
  `priority`), a fresh server's first requests (`first_request`); the clients they share
  (`clients`) and what they read of a server's process and pool (`probes`).
- `speed/`: what a feature costs or gains in time: `compile`, `quantize`, `step_cache`, `lora`
  (adapters mixed in a batch), `video` (videos batched step by step), `unet_rows` (the bound on
  step batching).
- `quality/`: what a feature costs the images, judged: `compile`, `quantize`, `step_cache`,
  `edits`, `diamond_lora` (the built-in adapter).
- `parallel/`: work spread over workers and threads, and the planner that spreads it: `shard`
  (the stage machinery's overhead), `replicas_and_stages`, `lone_split` (a lone request's rows),
  `sequence` and `tensor` (a lone call's tokens and blocks), `planner` (counted costs against
  the clock), `thread_count` and `thread_default`.
- `peers/`: ours beside other runtimes on the same CPU: OpenVINO (`openvino_served`,
  `openvino_unet`) and diffusers (`diffusers_pipeline`, `diffusers_sampling`,
  `diffusers_context_parallel`).
- `gpu/` with `gpu_check.py`: the GPU check, a phase per module (`python -m benchmarks.gpu_check`).
"""
