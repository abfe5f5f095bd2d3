"""What a feature costs or gains in time: compiling, quantizing, step caching, mixed adapters,
batched videos, and how a step's time grows with its rows. Their quality is `benchmarks.quality`'s."""
