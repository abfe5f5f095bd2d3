"""Loading a model folder and placing it: reading and checking the folder, the plan of its split,
quantized parts, where each part sits, the lanes that run the denoiser, the VAE's tiling, and the
graphs compiled before serving."""
