"""What a feature costs the images, under fixed seeds and judged by the built-in model's evaluator
or against the unchanged model: compiling, quantizing, step caching, edits, the diamond adapter."""
