"""Training-time augmentation of one mini-batch (method §7).

Every image gets its own RandAugment(2, 6) draw (on uint8 pixels, as
torchvision expects); the batch is then mixed by Mixup(α = 0.4) on even batch
indices and CutMix(α = 1.0) on odd ones, and normalized with the preset's
mean/std last. All three are torchvision's ``transforms.v2`` implementations.

Mixed labels come back as soft targets ``λ·onehot(y_a) + (1−λ)·onehot(y_b)``.
Cross-entropy is linear in the target, so ``CE(z, soft)`` equals method §7's
``λ·CE(z, y_a) + (1−λ)·CE(z, y_b)`` exactly (for CutMix λ is torchvision's
area-corrected λ, i.e. the true pixel share of ``y_a``).

torchvision draws from the *global* torch RNG. To keep randomness explicit,
each batch runs inside ``torch.random.fork_rng`` seeded from the caller's
``torch.Generator``: the same generator state gives bit-identical batches, and
the caller's global RNG state is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from feast_edge.data.images import normalize

MIXERS = ("mixup", "cutmix")
# Augmentation policies a training recipe can name: per-image transform, then (``+mix``) Mixup/CutMix.
POLICIES = ("randaugment+mix", "crop-flip+mix", "crop-flip", "randaugment", "none")
DEFAULT_POLICY = "randaugment+mix"  # method §7
_SEED_BOUND = 2**62


@dataclass(frozen=True)
class MixedBatch:
    """One augmented batch: normalized float images, soft targets and the mixer that made them."""

    images: torch.Tensor  # float32 [N, C, H, W], normalized
    targets: torch.Tensor  # float32 [N, classes], rows sum to 1
    mixer: str  # "mixup", "cutmix" or "none"

    def __len__(self) -> int:
        return int(self.images.shape[0])


def mixer_for(batch_index: int) -> str:
    """Mixup on even batches, CutMix on odd ones: the two alternate between batches (method §7)."""
    return MIXERS[batch_index % 2]


def plain_batch(
    images: torch.Tensor, labels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], classes: int
) -> MixedBatch:
    """The un-augmented batch: normalized pixels and one-hot targets (augmentation switched off)."""
    pixels = normalize(images.float().div(255.0), mean, std)
    return MixedBatch(pixels, F.one_hot(labels, classes).float(), "none")


def _transforms():
    """torchvision's ``transforms.v2``, imported when an augmenter is built: importing torchvision costs a
    command about two seconds of start-up (its models pull in torch._dynamo), paid only by the ones that augment."""
    from torchvision.transforms import v2

    return v2


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else a ValueError naming them."""
    if policy not in POLICIES:
        raise ValueError(f"augmentation policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    return policy


class _CropFlip:
    """Random crop of the image's own size after zero padding, then a horizontal flip with p = 0.5."""

    def __init__(self, padding: int) -> None:
        self.padding = padding
        self.v2 = _transforms()
        self.flip = self.v2.RandomHorizontalFlip()
        self.crops: dict[tuple[int, int], torch.nn.Module] = {}

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.padding:
            size = (int(image.shape[-2]), int(image.shape[-1]))
            crop = self.crops.setdefault(size, self.v2.RandomCrop(size, padding=self.padding))
            image = crop(image)
        return self.flip(image)


class BatchAugmenter:
    """A per-image transform, then Mixup/CutMix alternating by batch index, then normalization.

    ``policy`` (:data:`POLICIES`): ``randaugment+mix`` is method §7 (RandAugment(ops, magnitude) per
    image, Mixup/CutMix between batches); ``crop-flip`` is a random crop after zero padding by
    ``crop_padding`` pixels and a horizontal flip; ``+mix`` adds the Mixup/CutMix alternation; a
    policy without it keeps one-hot targets (``mixer`` ``"none"``).
    """

    def __init__(
        self,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        classes: int,
        randaugment: tuple[int, int] = (2, 6),
        mixup_alpha: float = 0.4,
        cutmix_alpha: float = 1.0,
        policy: str = DEFAULT_POLICY,
        crop_padding: int = 2,
    ) -> None:
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.classes = classes
        self.policy = check_policy(policy)
        self.mix = policy.endswith("+mix")
        ops, magnitude = randaugment
        v2 = _transforms()
        if policy.startswith("randaugment"):
            self.transform = v2.RandAugment(num_ops=ops, magnitude=magnitude)
        elif policy.startswith("crop-flip"):
            self.transform = _CropFlip(crop_padding)
        else:
            self.transform = None
        self.mixers = {
            "mixup": v2.MixUp(alpha=mixup_alpha, num_classes=classes),
            "cutmix": v2.CutMix(alpha=cutmix_alpha, num_classes=classes),
        }

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, batch_index: int, generator: torch.Generator
    ) -> MixedBatch:
        """Augment uint8 ``images`` [N, C, H, W] with int64 ``labels`` [N] on their device; randomness from ``generator`` only."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"augmentation needs uint8 images [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        seed = int(torch.randint(_SEED_BOUND, (1,), generator=generator))
        mixer = mixer_for(batch_index) if self.mix else "none"
        # Augment where the images are (the GPU that trains, or the CPU); the transforms draw their parameters
        # from the seeded global RNG, forked here so the caller's state (the GPU's too) is left as it was.
        with torch.random.fork_rng(devices=[images.device] if images.device.type == "cuda" else []):
            torch.manual_seed(seed)
            # One draw per image (a batch tensor would share one draw across the batch).
            augmented = images if self.transform is None else torch.stack([self.transform(image) for image in images])
            pixels = augmented.float().div_(255.0)
            if self.mix:
                pixels, targets = self.mixers[mixer](pixels, labels)
            else:
                targets = F.one_hot(labels, self.classes).float()
        return MixedBatch(normalize(pixels, self.mean, self.std), targets, mixer)
