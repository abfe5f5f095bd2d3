"""The built-in model: a small text-to-image latent diffusion model trained here on shapes."""
