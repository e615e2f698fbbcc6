"""Training recipes as preset data: the [train] table, its overrides, the augmentation policies, the lr schedule."""

from __future__ import annotations

import pytest
import torch

from feast_edge.errors import PresetError
from feast_edge.local.augment import POLICIES, BatchAugmenter
from feast_edge.local.recipe import TrainConfig, TrainError, recipe_config, scheduled_lr
from feast_edge.sim.setup import SimulationConfig, SimulationError
from feast_edge.space.preset import Preset, load_preset, load_preset_file

PAPER = ("paper-cifar100", "paper-cinic10", "paper-tinyimagenet")


@pytest.mark.parametrize("name", PAPER)
def test_paper_presets_keep_spec7_exactly(name):
    train, schedule = recipe_config(load_preset(name).recipe)
    spec = TrainConfig(
        lr=0.025,
        momentum=0.9,
        weight_decay=1e-4,
        clip_norm=10.0,
        kd_weight=0.5,
        batch_size=64,
        epochs=1,
        mixup_alpha=0.4,
        cutmix_alpha=1.0,
        randaugment=(2, 6),
        augment="randaugment+mix",
    )
    assert train == spec and schedule == "cosine"


def test_fmnist_small_has_its_own_recipe_and_the_simulation_uses_it():
    preset = load_preset("fmnist-small")
    assert preset.recipe, "fmnist-small names its own [train] recipe"
    train, schedule = SimulationConfig.of().recipe_settings()
    for key, value in preset.recipe.items():
        assert (schedule if key == "lr_schedule" else getattr(train, key)) == value


def test_options_override_the_recipe_and_enter_the_fingerprint():
    base = SimulationConfig.of()
    changed = SimulationConfig.of(
        lr=0.1, batch_size=16, epochs=2, augment="none", lr_schedule="constant", recipe={"mixup_alpha": 0.2}
    )
    train, schedule = changed.recipe_settings()
    assert (train.lr, train.batch_size, train.epochs, train.augment, train.mixup_alpha, schedule) == (
        0.1,
        16,
        2,
        "none",
        0.2,
        "constant",
    )
    assert base.fingerprint() != changed.fingerprint()
    assert changed.decisive()["train"] == train.settings()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"augment": "jitter"}, "augment = 'jitter' is unknown; choose one of randaugment+mix"),
        ({"lr_schedule": "step"}, "lr_schedule = 'step' is unknown; choose one of cosine, constant"),
        ({"recipe": {"warmup": 5}}, "unknown training setting(s) warmup"),
        ({"lr": -1.0}, "lr = -1.0 must be > 0"),
    ],
)
def test_a_bad_recipe_value_is_a_one_line_error(change, message):
    with pytest.raises(SimulationError, match="training recipe: ") as err:
        SimulationConfig.of(**change).recipe_settings()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_train_table_is_read_checked_and_round_trips(tmp_path):
    text = load_preset("fmnist-small").to_dict()
    source = (load_preset_file.__globals__["BUILTIN_DIR"] / "fmnist-small.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(
        source.replace('name = "fmnist-small"', 'name = "bad"').replace("[train]", "[train]\nwarmup_rounds = 3")
    )
    with pytest.raises(PresetError, match=r"\[train\] has unknown key\(s\) warmup_rounds; allowed: lr, lr_schedule"):
        load_preset_file(bad)
    again = Preset.from_dict(text)
    assert again == load_preset("fmnist-small") and again.recipe == load_preset("fmnist-small").recipe
    assert again.digest == load_preset("fmnist-small").digest  # the recipe does not shape tensors


def test_scheduled_lr():
    assert scheduled_lr("constant", 0.1, 7, 10) == 0.1
    assert scheduled_lr("cosine", 0.1, 0, 10) == pytest.approx(0.1)
    assert scheduled_lr("cosine", 0.1, 5, 10) == pytest.approx(0.05)
    with pytest.raises(TrainError):
        scheduled_lr("constant", 0.1, 10, 10)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_is_deterministic_and_mixes_only_with_mix(policy):
    images = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8)
    labels = torch.arange(8) % 10
    augment = BatchAugmenter((0.5,), (0.25,), 10, policy=policy)
    a = augment(images, labels, 1, torch.Generator().manual_seed(3))
    b = augment(images, labels, 1, torch.Generator().manual_seed(3))
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    assert a.images.shape == (8, 1, 28, 28) and torch.allclose(a.targets.sum(1), torch.ones(8))
    one_hot = bool(((a.targets == 0) | (a.targets == 1)).all())
    assert one_hot != policy.endswith("+mix") or a.mixer == "cutmix"  # a CutMix box can, rarely, leave targets one-hot
    if policy == "none":
        assert torch.allclose(a.images, (images.float() / 255 - 0.5) / 0.25)


def test_crop_flip_keeps_the_picture_and_moves_it():
    images = torch.zeros((16, 1, 28, 28), dtype=torch.uint8)
    images[:, :, 10:18, 4:8] = 255  # an off-centre bar: a flip or a shift moves it
    out = BatchAugmenter((0.0,), (1.0,), 10, policy="crop-flip", crop_padding=2)(
        images, torch.zeros(16, dtype=torch.long), 0, torch.Generator().manual_seed(0)
    )
    moved = [not torch.equal(out.images[i], images[i].float() / 255) for i in range(16)]
    assert any(moved)
    assert all(float(x.sum()) <= 8 * 4 + 1e-6 for x in out.images)  # a crop never adds ink, padding is black


def test_every_training_setting_can_be_written_in_a_presets_train_table() -> None:
    from dataclasses import fields

    from feast_edge.space.preset import RECIPE_KEYS

    settings = {f.name for f in fields(TrainConfig)} - {"variants"}  # the ablation is a run option, not a recipe
    assert settings <= set(RECIPE_KEYS), sorted(settings - set(RECIPE_KEYS))
