"""The settings, split by concern: every field still one flag and one variable of `Settings`,
each concern's slice holding its own fields alone, and a validation that measures nothing (what
`--dtype auto` serves on a CPU is timed where `serve`, `plan` and an app start)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from server import startup
from server.engine.planning.precision import DtypeChoice
from server.settings import CONCERNS, LimitSettings, ModelSettings, Settings
from server.startup import decide_dtype, served_dtype


def measured(*_args: object) -> None:
    raise AssertionError("measured")


def test_building_the_settings_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dtype auto` with a CPU stage is the one setting a measurement decides: building the
    settings, reading every property and taking every slice never calls it; startup does."""
    monkeypatch.setattr(startup, "choose_cpu_dtype", measured)
    settings = Settings(devices="cpu", dtype="auto")
    ours = [
        name
        for name in dir(Settings)
        if isinstance(prop := getattr(Settings, name, None), property)
        and prop.fget.__module__.startswith("server.settings")
    ]
    assert {"served_name", "adapters", "key_queue_limit", "trusted_hosts"} <= set(ours)
    for name in ours:
        getattr(settings, name)
    for concern in CONCERNS:
        concern.of(settings)
    assert settings.dtype == "auto"
    with pytest.raises(AssertionError, match="measured"):
        decide_dtype(settings)


def test_dtype_auto_is_decided_once_and_then_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement is the host's (a true boundary): its result is given here."""
    timed = DtypeChoice("bfloat16", "timed faster", 1.5)
    monkeypatch.setattr(startup, "choose_cpu_dtype", lambda *_args: timed)
    decided = decide_dtype(Settings(devices="cpu", dtype="auto"))
    assert decided.dtype == "bfloat16" and decided.dtype_choice == timed.view()
    assert decided.model_copy(update={"max_batch": 3}).dtype_choice == timed.view()  # carried along
    monkeypatch.setattr(startup, "choose_cpu_dtype", measured)
    assert decide_dtype(decided) is decided and served_dtype(decided) == torch.bfloat16
    assert served_dtype(Settings(devices="cpu", dtype="float16")) == torch.float16


def test_every_field_belongs_to_one_concern_and_keeps_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [name for concern in CONCERNS for name in concern.model_fields]
    assert len(names) == len(set(names)) and set(names) == set(Settings.model_fields)
    monkeypatch.setenv("DIFFSHARD_MAX_BATCH", "3")
    monkeypatch.setenv("DIFFSHARD_VIDEO_FPS", "24")
    settings = Settings(devices="cpu")
    assert (settings.max_batch, settings.video_fps) == (3, 24)


def test_a_slice_holds_its_concern_alone_and_which_fields_were_set() -> None:
    settings = Settings(devices="cpu", max_batch=4, max_queue=10, port=9000)
    limits = LimitSettings.of(settings)
    assert type(limits) is LimitSettings and (limits.max_batch, limits.key_queue_limit) == (4, 5)
    assert {"max_batch", "max_queue"} <= limits.model_fields_set and "max_n" not in limits.model_fields_set
    assert not hasattr(limits, "port") and not hasattr(limits, "devices")
    model = ModelSettings.of(settings)
    assert model.devices == ("cpu",) and model.served_name == settings.served_name
    assert not hasattr(model, "max_batch")


def test_a_check_across_concerns_names_its_flag() -> None:
    """A step cache the model's family does not serve: the limits' default against the model's."""
    with pytest.raises(ValidationError, match=r"--step-cache \(DIFFSHARD_STEP_CACHE\): 'first_block' does"):
        Settings(devices="cpu", step_cache="first_block")
