"""Edits on the built-in model, judged by its evaluator (issue 24; the figures are
`python -m benchmarks.quality.edits`'s): img2img turns a red circle blue, inpainting repaints
only the masked half and returns the other as sent."""

from __future__ import annotations

from benchmarks.quality.edits import TARGET, img2img, inpainting
from server.demo import MODEL_DIR
from server.pipeline import Pipeline


def test_img2img_turns_a_dataset_red_circle_blue_and_inpainting_keeps_the_unmasked_half() -> None:
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    assert img2img(pipeline, seeds=12)["judged_right"] >= TARGET
    kept = inpainting(pipeline, seeds=4)
    assert kept["kept_half_max_abs_diff"] <= 2  # of 255: the image's own pixels (issue 36)
    assert kept["repainted_half_mean_abs_diff"] > 3 * kept["kept_half_mean_abs_diff"]
