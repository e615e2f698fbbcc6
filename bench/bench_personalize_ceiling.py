"""How far personalization could go on a finished demo's devices: each served architecture trained centrally.

The architecture is trained on the federation's data in one place and judged on each device's own held-out split
and class mix.

    PYTHONPATH=. python bench/bench_personalize_ceiling.py feast-demo [--devices raspberry-pi-5] [--epochs 20]

A device's own accuracy is its model's accuracy on each class weighted by how often the device sees that class.
The Fashion-MNIST test set (never on any device) gives every class's recall, so a model's *expected* own accuracy is
``Σ_c p_device(c) · recall_c`` with ``p_device`` the class mix of the device's own training folder. For each device
of a ``feast-edge demo`` run directory this prints, on that estimate:

* **served**: the model the server served (rebuilt as the agent rebuilt it), beside its measured own held-out
  accuracy (how well the estimate tracks the measurement);
* **served + prior**: the same model with the best prior correction for the device (τ chosen on the test set:
  an oracle, which no device can do);
* **central / central + prior**: the served architecture trained from scratch on the pooled training splits of all
  the demo's devices (``--pool devices``, the default: the federation's own data, held-out splits excluded, so the
  central model is also *measured* on each device's held-out split) or on all 60,000 Fashion-MNIST training images
  (``--pool all``: estimate only), with and without the best prior correction: what this architecture could give the
  device if the federation's data were in one place, the ceiling of a personalization of the federated model.
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F
from _timing import demo_arguments, machine
from rich.table import Table

from feast_edge.agent.local_data import load_clients
from feast_edge.agent.on_device import served_model
from feast_edge.cli.common import make_console
from feast_edge.data.images import load_fashion_mnist, normalize
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.personalize.prior import class_prior, prior_offsets
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset, load_preset
from feast_edge.space.static import StaticResNet

TAUS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


@torch.no_grad()
def _test_logits(model: StaticResNet, images: torch.Tensor, preset: Preset) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x).float() for x in pixel_batches(images, preset, 500, "cpu")])


def _expected(logits: torch.Tensor, labels: torch.Tensor, mix: torch.Tensor, offsets: torch.Tensor) -> float:
    """Σ_c mix_c · recall_c of ``logits + offsets`` on the test labels."""
    right = (logits + offsets).argmax(dim=1) == labels
    recall = torch.stack([right[labels == c].float().mean() for c in range(mix.numel())])
    return float((mix * recall.double()).sum())


def _own(model: StaticResNet, images: torch.Tensor, labels: torch.Tensor, preset: Preset) -> float:
    """``model``'s accuracy on a device's own held-out split."""
    return int((_test_logits(model, images, preset).argmax(1) == labels).sum()) / max(1, labels.numel())


def _best_prior(
    logits: torch.Tensor, labels: torch.Tensor, mix: torch.Tensor, prior: torch.Tensor
) -> tuple[float, float]:
    """The best expected own accuracy over TAUS, and its τ."""
    return max((_expected(logits, labels, mix, prior_offsets(prior, tau)), tau) for tau in TAUS)


def _central(
    arch: Arch, preset: Preset, images: torch.Tensor, labels: torch.Tensor, epochs: int, seed: int, say
) -> StaticResNet:
    """``arch`` trained from scratch on every training image: SGD (momentum 0.9, weight decay 5e-4), the preset's
    learning rate on a cosine schedule, batch 128, no augmentation (the preset's own)."""
    torch.manual_seed(seed)
    model = StaticResNet(arch_layout(preset, arch))
    optimizer = torch.optim.SGD(
        model.parameters(), lr=dict(preset.train).get("lr", 0.05), momentum=0.9, weight_decay=5e-4
    )
    steps = epochs * math.ceil(labels.numel() / 128)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for epoch in range(epochs):
        began, total = time.perf_counter(), 0.0
        for index in torch.randperm(labels.numel(), generator=generator).split(128):
            x = normalize(images[index].float().div_(255.0), preset.mean, preset.std)
            loss = F.cross_entropy(model(x), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss.detach()) * index.numel()
        say(f"  epoch {epoch + 1}/{epochs}: loss {total / labels.numel():.4f} ({time.perf_counter() - began:.0f} s)")
    return model.eval()


def main() -> None:
    parser = demo_arguments(__doc__)
    parser.add_argument("--devices", help="comma-separated device names (default: every device of the demo)")
    parser.add_argument(
        "--pool", choices=("devices", "all"), default="devices", help="what the central model trains on"
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = make_console()
    console.print(machine())
    test = load_fashion_mnist(args.data, "test")
    manifests = [json.loads(p.read_text()) for p in sorted((args.demo / "server" / "models").glob("*.json"))]
    manifests = [m for m in manifests if "device" in m]  # not index.json
    preset = load_preset(manifests[0]["preset"])
    clients = {
        m["device"]: load_clients(args.demo / "devices" / m["device"], m["device"], task=preset.task)[0]
        for m in manifests
    }
    if args.pool == "all":
        train = load_fashion_mnist(args.data, "train")
        pool_images, pool_labels, pooled = train.images, train.labels.long(), "all 60,000 training images"
    else:
        pool_images = torch.cat([c.images for c in clients.values()])
        pool_labels = torch.cat([c.labels for c in clients.values()]).long()
        pooled = f"the {len(clients)} devices' {pool_labels.numel():,} training examples"
    test_labels = test.labels.long()
    wanted = set(args.devices.split(",")) if args.devices else None
    central: dict[str, StaticResNet] = {}  # the centrally trained architecture, by its JSON
    table = Table(title=f"{args.demo}: own accuracy, measured and expected from the test set's per-class recall")
    for col in (
        "device",
        "classes (share)",
        "served: measured own",
        "served: expected",
        "served + prior (τ)",
        "central: measured own",
        "central: expected",
        "central + prior (τ)",
    ):
        table.add_column(col, justify="left" if col in ("device", "classes (share)") else "right")
    found: dict[str, dict] = {}
    for manifest in manifests:
        device, data = manifest["device"], clients[manifest["device"]]
        if wanted and device not in wanted:
            continue
        counts = torch.bincount(data.labels.long(), minlength=preset.classes).double()
        mix, prior = counts / counts.sum(), class_prior(data.labels, preset.classes)
        blob = (args.demo / "server" / "models" / manifest["file"]).read_bytes()
        served = served_model(blob, manifest, data, preset).model
        logits = _test_logits(served, test.images, preset)
        key = json.dumps(manifest["arch"], sort_keys=True)
        if key not in central:
            console.print(f"{device}: training its architecture ({manifest['macs'] / 1e6:.2f}M MACs) on {pooled}")
            arch = Arch.from_dict(manifest["arch"]).validated(preset)
            central[key] = _central(arch, preset, pool_images, pool_labels, args.epochs, args.seed, console.print)
        zero, holdout = torch.zeros(preset.classes), data.holdout_labels.long()
        central_logits = _test_logits(central[key], test.images, preset)
        row = {
            "measured": _own(served, data.holdout_images, holdout, preset),
            "served": _expected(logits, test_labels, mix, zero),
            "served_prior": _best_prior(logits, test_labels, mix, prior),
            "central_measured": _own(central[key], data.holdout_images, holdout, preset)
            if args.pool == "devices"
            else None,
            "central": _expected(central_logits, test_labels, mix, zero),
            "central_prior": _best_prior(central_logits, test_labels, mix, prior),
            "central_test": float((central_logits.argmax(1) == test_labels).float().mean()),
        }
        found[device] = row
        shares = ", ".join(
            f"{preset.task.classes[c]} {100 * float(mix[c]):.0f}%" for c in mix.argsort(descending=True)[:4] if mix[c]
        )
        table.add_row(
            device,
            shares,
            f"{100 * row['measured']:.1f}%",
            f"{100 * row['served']:.1f}%",
            f"{100 * row['served_prior'][0]:.1f}% ({row['served_prior'][1]:g})",
            "-" if row["central_measured"] is None else f"{100 * row['central_measured']:.1f}%",
            f"{100 * row['central']:.1f}%",
            f"{100 * row['central_prior'][0]:.1f}% ({row['central_prior'][1]:g})",
        )
    console.print(table)
    for device, row in found.items():
        console.print(
            f"{device}: the centrally trained architecture scores {100 * row['central_test']:.1f}% on the test set"
        )
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
