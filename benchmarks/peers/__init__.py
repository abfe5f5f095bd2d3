"""Ours beside other runtimes on the same CPU and weights: OpenVINO (a served image, a UNet
forward) and diffusers (its pipeline, its sampling time, its context parallelism)."""
