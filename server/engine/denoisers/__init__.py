"""What a denoiser is: its blocks in execution order, how each runs, where step caching cuts it."""
