"""Presets are data: built-ins load, user files load without code changes, bad files say what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from feast_edge.errors import PresetError
from feast_edge.space.preset import available_presets, load_preset, load_preset_file
from strategies import TINY_PRESET


def test_paper_presets_match_spec():
    p = load_preset("paper-cifar100")
    assert (p.in_channels, p.input_size, p.classes) == (3, 32, 100)
    assert p.stem_channels == 64 and p.stem_stride == 1
    assert p.stage_channels == (128, 256, 512, 1024) and p.stage_strides == (1, 2, 2, 2)
    assert p.max_extra_blocks == 8
    assert p.expansion_ratios == (0.10, 0.14, 0.18, 0.22, 0.25)
    assert p.width_multipliers == tuple(round(0.1 * i, 1) for i in range(1, 11))
    cinic = load_preset("paper-cinic10")
    assert cinic.classes == 10 and cinic.digest != p.digest
    tiny_imagenet = load_preset("paper-tinyimagenet")
    assert (tiny_imagenet.input_size, tiny_imagenet.stem_stride, tiny_imagenet.classes) == (64, 2, 200)


def test_cpu_preset_is_one_channel_28px():
    p = load_preset("fmnist-small")
    assert (p.in_channels, p.input_size, p.classes) == (1, 28, 10)


def test_user_preset_by_path_and_search_path(monkeypatch):
    monkeypatch.delenv("FEAST_EDGE_PRESET_PATH")  # the session's (tests/conftest.py)
    by_path = load_preset(str(TINY_PRESET))
    assert by_path.name == "test-tiny"
    assert "test-tiny" not in available_presets()
    monkeypatch.setenv("FEAST_EDGE_PRESET_PATH", str(TINY_PRESET.parent))
    assert "test-tiny" in available_presets()
    assert load_preset("test-tiny") == by_path


def test_unknown_preset_lists_choices():
    with pytest.raises(PresetError, match=r"unknown preset 'nope'; choose one of: .*paper-cifar100"):
        load_preset("nope")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(TINY_PRESET.read_text().replace(*text.split("|")))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        ("strides = [1, 2, 2]|strides = [1, 2]", r"stages.strides has 2 entries but stages.channels has 3"),
        ("mean = [0.5]|mean = [0.5, 0.5]", r"input.mean has 2 values; it needs one per input channel \(1\)"),
        (
            "expansion_ratios = [0.5, 1.0]|expansion_ratios = [1.0, 0.5]",
            r"expansion_ratios must be strictly increasing",
        ),
        ("max_extra_blocks = 2|max_extra_blocks = -1", r"max_extra_blocks = -1 must be >= 0"),
        ("classes = 5|", r"lacks the field 'classes'"),
        ('name = "test-tiny"|name = [1', r"is not valid TOML"),
    ],
)
def test_bad_preset_file_names_the_field(tmp_path, edit, message):
    with pytest.raises(PresetError, match=message):
        load_preset_file(_write(tmp_path, edit))


def test_missing_preset_file(tmp_path):
    with pytest.raises(PresetError, match="does not exist"):
        load_preset(str(tmp_path / "missing.toml"))


def test_digest_ignores_name_but_not_shape(tiny):
    renamed = type(tiny)(**{**tiny.to_dict(), "name": "other", "description": "x"})
    assert renamed.digest == tiny.digest
    wider = type(tiny)(**{**tiny.to_dict(), "stem_channels": 24})
    assert wider.digest != tiny.digest
