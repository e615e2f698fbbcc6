"""Personalization on the device (feast_edge.personalize): prior correction against NumPy, fine-tuning moves only what
its method may, and honest selection never ships a model worse than the served one on the selection split."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.data.holdout import holdout_split
from feast_edge.evaluate.evaluation import correct_count, pixel_batches
from feast_edge.personalize.finetune import fine_tuned
from feast_edge.personalize.fleet import OwnRow, fleet_summary, personalization_record, summary_lines, tuned_lines
from feast_edge.personalize.prior import SMOOTHING, class_prior, prior_corrected, prior_offsets
from feast_edge.personalize.select import (
    MIN_TRAINING,
    SELECTION_SEED,
    SELECTION_SHARE,
    STRENGTHS,
    Choice,
    PersonalizeError,
    personal_step,
    personalize,
    worst_decile,
)
from feast_edge.personalize.tuned import Tuned
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset_file
from feast_edge.space.supernet import Supernet
from strategies import FMNIST_TINY

PRESET = load_preset_file(FMNIST_TINY)


@pytest.fixture(scope="module")
def served():
    cache = load_cache(PRESET)
    return extract(Supernet(PRESET, seed=3), cache.entries[len(cache.entries) // 2].arch).eval()


def _images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)


def _logits(model, images) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([model(x) for x in pixel_batches(images, PRESET, 100)]).double().numpy()


def test_prior_correction_adds_tau_log_of_the_smoothed_class_prior_to_every_logit(served) -> None:
    labels = torch.tensor([6] * 30 + [0] * 5 + [2] * 1)  # classes 1, 3, 4, 5, 7, 8, 9 never seen
    images = _images(20, 1)
    counts = np.bincount(labels.numpy(), minlength=10)
    want_prior = (counts + SMOOTHING) / (counts.sum() + SMOOTHING * 10)
    assert class_prior(labels, 10).numpy() == pytest.approx(want_prior, rel=1e-12)
    for tau in (0.0, 0.5, 1.0):
        personal = prior_corrected(served, prior_offsets(class_prior(labels, 10), tau))
        want = _logits(served, images) + tau * np.log(want_prior)
        assert np.allclose(_logits(personal, images), want, atol=1e-5)
    assert np.allclose(_logits(served, images), _logits(served, images))  # the served model is a copy's source only


def test_head_and_bn_fine_tuning_move_only_their_parameters_and_leave_the_served_model(served) -> None:
    images, labels = _images(48, 2), torch.randint(0, 10, (48,), generator=torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in served.state_dict().items()}
    head, bn = (
        fine_tuned(served, images, labels, PRESET, m, [1], torch.Generator().manual_seed(0))[0] for m in ("head", "bn")
    )
    assert all(torch.equal(v, served.state_dict()[k]) for k, v in before.items())
    moved = {
        name: {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        for name, model in (("head", head), ("bn", bn))
    }
    assert moved["head"] == {"classifier.weight", "classifier.bias"}
    assert moved["bn"] and all(".bn" in k or k.startswith("stem.bn") for k in moved["bn"])
    assert any(k.endswith("running_mean") for k in moved["bn"])  # FedBN: the device's own statistics


def test_a_strong_proximal_pull_keeps_the_model_nearer_the_served_one(served) -> None:
    images, labels = _images(64, 4), torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(4))
    weak, strong = fine_tuned(
        served, images, labels, PRESET, "proximal", [0.0, 100.0], torch.Generator().manual_seed(0)
    )

    def distance(model) -> float:
        return sum(float(((p - q) ** 2).sum().detach()) for p, q in zip(model.parameters(), served.parameters()))

    assert 0 < distance(strong) < distance(weak)


def _skewed(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixels whose labels are 90 % class 6: a device whose users see mostly shirts."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.where(torch.rand(n, generator=g) < 0.9, 6, torch.randint(0, 10, (n,), generator=g))
    return _images(n, seed), labels


def test_auto_on_a_skewed_device_beats_the_served_model_on_its_selection_and_held_out_splits(served) -> None:
    images, labels = _skewed(200, 5)
    held_images, held_labels = _skewed(60, 6)
    outcome, own = personal_step(served, images, labels, held_images, held_labels, PRESET, Choice.parse("auto"))
    assert outcome.model is not None and outcome.method in ("prior", "head", "bn", "proximal")
    # The recorded counts are the model's on the selection split the test carves the same way, independently:
    _, select = holdout_split(labels, SELECTION_SHARE, SELECTION_SEED)
    served_right = correct_count(served, images[select], labels[select], PRESET)
    mine = correct_count(outcome.model, images[select], labels[select], PRESET)
    assert (outcome.selection_global, outcome.selection_personal) == (served_right, mine) and mine > served_right
    assert own.examples == 60 and own.personal > own.served
    assert own.personal == correct_count(outcome.model, held_images, held_labels, PRESET)
    assert outcome.metadata()["personal_selection_examples"] == len(select)
    assert "chose" in outcome.reason and outcome.method in outcome.reason


def test_a_personal_model_of_a_device_with_three_classes_says_it_was_tuned_to_those_three(served) -> None:
    g = torch.Generator().manual_seed(11)
    three = torch.tensor([0, 2, 6])  # T-shirt_top, Pullover, Shirt: the device holds no other class
    labels, held_labels = (three[torch.randint(0, 3, (n,), generator=g)] for n in (120, 30))
    choice = Choice.parse("prior:1")  # asked for by name: a personal model is written whatever it scores
    outcome, own = personal_step(served, _images(120, 12), labels, _images(30, 13), held_labels, PRESET, choice)
    words = "tuned to 3 of 10 classes: T-shirt_top, Pullover, Shirt; serve the global model for the others"
    assert outcome.model is not None and outcome.tuned == Tuned(("T-shirt_top", "Pullover", "Shirt"), 10)
    assert outcome.tuned.words() == words
    assert outcome.tuned.untuned(PRESET.task.classes) == [PRESET.task.classes[k] for k in (1, 3, 4, 5, 7, 8, 9)]
    meta = outcome.metadata()  # what the agent's manifest and ONNX file record
    assert (meta["personal_classes"], meta["personal_task_classes"]) == (["T-shirt_top", "Pullover", "Shirt"], 10)
    # The row simulate and the Flower ServerApp record, its summary, and the line under the summary.
    row = OwnRow.of("client-007", 1_000_000, outcome, own, 0.1)
    assert row.to_dict()["personal_classes"] == ["T-shirt_top", "Pullover", "Shirt"] and row.to_dict()["tuned"] == words
    assert fleet_summary([row], "prior:1")["tuned_to_fewer_classes"] == 1
    assert tuned_lines([row.to_dict()]) == [f"client-007: personal model {words}"]
    record = personalization_record([row], "prior:1")
    assert summary_lines(record)[0].startswith("personalization: 1 of 1 clients chose a personal model (1 tuned to ")
    assert summary_lines(record)[1:] == tuned_lines(record["clients"])
    # Every class held: nothing to say; no personal model: no classes.
    every = personalize(served, _images(100, 14), torch.arange(100) % 10, PRESET, choice, holdout=10)
    assert every.tuned == Tuned(PRESET.task.classes, 10) and every.tuned.words() == ""
    off = personalize(served, _images(100, 14), labels[:100], PRESET, Choice.parse("off"), holdout=10)
    assert off.tuned is None and "personal_classes" not in off.metadata()


def test_a_device_sends_its_class_names_only_while_they_fit_one_metrics_message() -> None:
    few = Tuned(("T-shirt_top", "Pullover"), 10)
    assert few.to_metrics() == {"personal_classes": ["T-shirt_top", "Pullover"], "personal_task_classes": 10}
    many = Tuned(tuple(f"class-{k:04d}-" + "x" * 80 for k in range(400)), 500)  # 36,000 characters of names
    assert many.to_metrics() == {} and len(many.to_dict()["personal_classes"]) == 400  # the manifest keeps them


def test_rows_written_before_the_classes_say_nothing_of_them() -> None:
    old = {"client": "client-001", "method": "prior", "strength": 1.0, "examples": 10, "served_correct": 5}
    assert tuned_lines([old, {**old, "personal_classes": ["a", "a"], "personal_task_classes": 3}]) == []


def test_auto_keeps_the_served_model_when_nothing_beats_it_on_the_selection_split(served) -> None:
    served = copy.deepcopy(served)
    with torch.no_grad():
        served.classifier.weight.mul_(30)  # decisive logits: images of different brightness get different classes
    g = torch.Generator().manual_seed(7)
    shade = torch.randint(0, 256, (120, 1, 1, 1), generator=g)
    images = (shade + torch.randint(-20, 20, (120, 1, 28, 28), generator=g)).clamp(0, 255).to(torch.uint8)
    labels = torch.from_numpy(_logits(served, images).argmax(1))  # the served model is right on every example
    assert torch.unique(labels).numel() >= 3
    outcome = personalize(served, images, labels, PRESET, Choice.parse("auto"), holdout=10)
    assert outcome.model is None and outcome.selection_personal is None
    assert outcome.reason.startswith("no method beat the served model on the selection split")
    assert (
        len(outcome.candidates) == sum(map(len, STRENGTHS.values()))
        and max(c.correct for c in outcome.candidates) <= outcome.selection_global
    )
    # Asked for by name, the method's best strength is written, and said not to be better:
    asked = personalize(served, images, labels, PRESET, Choice.parse("head"), holdout=10)
    assert asked.model is not None and asked.method == "head" and "not better than the served model" in asked.reason


@pytest.mark.parametrize(
    ("labels", "holdout", "choice", "reason"),
    [
        (torch.full((80,), 3), 8, "auto", "its training data holds one class"),
        (torch.arange(80) % 10, 0, "auto", "no held-out split"),
        (torch.arange(MIN_TRAINING - 1) % 10, 8, "prior", f"fewer than the {MIN_TRAINING} personalization needs"),
        (torch.arange(80) % 10, 8, "off", "personalization is off"),
    ],
    ids=["one-class", "no-holdout", "too-few", "off"],
)
def test_a_device_that_cannot_personalize_keeps_the_served_model_with_a_one_line_reason(
    served, labels, holdout, choice, reason
) -> None:
    outcome = personalize(served, _images(len(labels), 8), labels, PRESET, Choice.parse(choice), holdout=holdout)
    assert outcome.model is None and reason in outcome.reason and "\n" not in outcome.reason


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("best", "is unknown; choose one of auto, off, prior, head, bn, proximal"),
        ("auto:1", "takes no strength"),
        ("head:0", "must be a whole number of epochs in [1, 20]"),
        ("head:1.5", "must be a whole number of epochs"),
        ("prior:-1", "its tau must be a number in [0, 4]"),
        ("prior:1e9", "its tau must be a number in [0, 4]"),
    ],
)
def test_an_unknown_personalize_setting_is_refused_naming_the_choices(text, fragment) -> None:
    with pytest.raises(PersonalizeError) as caught:
        Choice.parse(text)
    assert fragment in str(caught.value)


def test_a_fixed_strength_is_the_only_candidate() -> None:
    assert Choice.parse("prior:0.5").candidates() == [("prior", (0.5,))]
    assert str(Choice.parse(" head : 3 ")) == "head:3" and Choice.parse("off").candidates() == []


def test_the_worst_decile_is_the_mean_of_the_lowest_tenth() -> None:
    assert worst_decile([0.9] * 18 + [0.1, 0.3]) == pytest.approx(0.2)
    assert worst_decile([0.5, 0.7]) == 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (PyTorch sees none here)")
def test_personalization_on_the_gpu_computes_what_it_computes_on_the_cpu(served, full_float32) -> None:
    images, labels = _skewed(200, 9)
    held_images, held_labels = _skewed(60, 10)
    for choice in ("prior:1", "head:2", "proximal:0.1"):
        cpu = personal_step(served, images, labels, held_images, held_labels, PRESET, Choice.parse(choice))
        gpu = personal_step(
            served, images, labels, held_images, held_labels, PRESET, Choice.parse(choice), device="cuda"
        )
        assert next(served.parameters()).device.type == "cpu"  # the served model is left where it was
        assert gpu[0].model is not None and next(gpu[0].model.parameters()).device.type == "cpu"
        if cpu[0].model is not None:
            assert np.allclose(_logits(gpu[0].model, held_images), _logits(cpu[0].model, held_images), atol=1e-3)
        assert abs(gpu[1].personal - cpu[1].personal) <= 1 and gpu[1].served == cpu[1].served
