"""Where a denoiser's blocks go: counted and measured costs, the plans and the search."""
