"""The generation pipeline: load a diffusers folder, denoise requests step by step, decode."""
