"""Training-time augmentation (method §7): torchvision RandAugment + alternating Mixup/CutMix, seeded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from feast_edge.data.images import load_fashion_mnist, normalize
from feast_edge.local.augment import BatchAugmenter, MixedBatch, mixer_for, plain_batch

MEAN, STD, CLASSES = (0.2860,), (0.3530,), 10


@pytest.fixture(scope="module")
def fmnist(fashion_mnist_dir) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_fashion_mnist(fashion_mnist_dir, "test")
    return data.images[:32], data.labels[:32]


def augmenter(**kw) -> BatchAugmenter:
    return BatchAugmenter(MEAN, STD, CLASSES, **kw)


def run(aug: BatchAugmenter, images: torch.Tensor, labels: torch.Tensor, batch_index: int, seed: int) -> MixedBatch:
    return aug(images, labels, batch_index, torch.Generator().manual_seed(seed))


def test_same_seed_gives_identical_batches_and_different_seed_differs(fmnist):
    images, labels = fmnist
    aug = augmenter()
    a, b, c = (run(aug, images, labels, 0, s) for s in (5, 5, 6))
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.images, c.images)


def test_callers_global_rng_is_left_untouched(fmnist):
    images, labels = fmnist
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    run(augmenter(), images, labels, 1, seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_torchvision_transforms_run_randaugment_per_image_and_mixers_alternate(fmnist, monkeypatch):
    calls: list[str] = []
    for cls in (v2.RandAugment, v2.MixUp, v2.CutMix):
        original = cls.forward

        def spy(self, *inputs, _original=original, _name=cls.__name__):
            calls.append(_name)
            return _original(self, *inputs)

        monkeypatch.setattr(cls, "forward", spy)
    images, labels = fmnist
    aug = augmenter()
    mixers = [run(aug, images, labels, i, seed=i).mixer for i in range(4)]
    assert mixers == ["mixup", "cutmix", "mixup", "cutmix"] == [mixer_for(i) for i in range(4)]
    assert [c for c in calls if c != "RandAugment"] == ["MixUp", "CutMix", "MixUp", "CutMix"]
    assert calls.count("RandAugment") == 4 * len(images)


def test_randaugment_draws_differ_between_images_of_one_batch(fmnist):
    # Identical images with identical labels: mixing changes nothing, so any
    # difference between outputs comes from per-image RandAugment draws.
    image = fmnist[0][:1].expand(16, -1, -1, -1).contiguous()
    labels = torch.zeros(16, dtype=torch.int64)
    out = run(augmenter(), image, labels, 0, seed=3).images
    assert len({tuple(x.flatten().tolist()) for x in out}) > 1


def test_normalization_comes_after_augmentation(fmnist):
    # No RandAugment ops and a batch of one repeated image: the mixers are the
    # identity, so the output is exactly the normalized pixels.
    image = fmnist[0][:1].expand(8, -1, -1, -1).contiguous()
    labels = torch.full((8,), 3, dtype=torch.int64)
    for batch_index in (0, 1):
        out = run(augmenter(randaugment=(0, 0)), image, labels, batch_index, seed=0)
        assert torch.allclose(out.images, normalize(image.float() / 255, MEAN, STD), atol=1e-6)
        assert torch.equal(out.targets, F.one_hot(labels, CLASSES).float())


def test_mixup_is_a_convex_pair_and_cutmix_pastes_a_box(fmnist):
    images, labels = fmnist
    pixels = normalize(images.float() / 255, MEAN, STD)
    partner = pixels.roll(1, 0)  # torchvision pairs each sample with its predecessor
    mixed = run(augmenter(randaugment=(0, 0)), images, labels, 0, seed=1)
    i = int(torch.nonzero(labels != labels.roll(1, 0))[0])
    lam = float(mixed.targets[i, labels[i]])
    assert 0 < lam < 1
    assert torch.allclose(mixed.images, lam * pixels + (1 - lam) * partner, atol=1e-5)
    cut = run(augmenter(randaugment=(0, 0)), images, labels, 1, seed=1).images
    from_self = torch.isclose(cut, pixels, atol=1e-6)
    from_partner = torch.isclose(cut, partner, atol=1e-6)
    assert torch.all(from_self | from_partner)
    assert (~from_self).any(), "CutMix pasted nothing"


def test_soft_target_ce_equals_the_lambda_mixed_ce(fmnist):
    images, labels = fmnist
    batch = run(augmenter(), images, labels, 1, seed=7)  # CutMix: area-corrected lambda
    y_a, y_b = labels, labels.roll(1, 0)
    same = y_a == y_b
    lam = batch.targets[torch.arange(len(labels)), y_a]
    lam = torch.where(same, torch.ones_like(lam), lam)
    assert torch.allclose(batch.targets.sum(1), torch.ones(len(labels)))
    logits = torch.randn(len(labels), CLASSES, generator=torch.Generator().manual_seed(0))
    soft = F.cross_entropy(logits, batch.targets, reduction="none")
    ce_a = F.cross_entropy(logits, y_a, reduction="none")
    ce_b = F.cross_entropy(logits, y_b, reduction="none")
    assert torch.allclose(soft, lam * ce_a + (1 - lam) * ce_b, atol=1e-5)


def test_plain_batch_is_normalized_one_hot(fmnist):
    images, labels = fmnist
    batch = plain_batch(images, labels, MEAN, STD, CLASSES)
    assert batch.mixer == "none"
    assert torch.equal(batch.targets.argmax(1), labels)
    assert torch.allclose(batch.images, normalize(images.float() / 255, MEAN, STD))


def test_rejects_float_images(fmnist):
    with pytest.raises(ValueError, match="uint8"):
        run(augmenter(), fmnist[0].float(), fmnist[1], 0, seed=0)
