"""The built-in model: a small text-to-image latent diffusion model trained here on shapes."""

from pathlib import Path

MODEL_DIR = Path(__file__).parent / "model"  # the committed pipeline folder, the service's default
