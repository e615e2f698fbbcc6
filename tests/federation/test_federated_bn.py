"""The server's side of federated BN statistics (server/bn_calibration.py) over a real round exchange, with scripted
devices that compute their statistics as the agent does (``on_device.answer_calibration``) or lie."""

from __future__ import annotations

from pathlib import Path

import torch

from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.on_device import answer_calibration
from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.bn_stats import combine_statistics, decode_statistics, encode_statistics, layer_channels
from feast_edge.protocol import Calibrate, Register
from feast_edge.server.bn_calibration import FederatedCalibration
from feast_edge.server.devices import DeviceBook
from feast_edge.server.registry import Registry
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.messages import Presence, parse
from tests.federation.test_exchange import FED, _exchange, _upload

PRESET = load_preset("fmnist-small")
CACHE = load_cache(PRESET)
SMALL, LARGE = CACHE.entries[0], CACHE.entries[-1]


def _client(device: str, n: int, seed: int) -> LocalClient:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=g)
    return LocalClient(device, images, labels, None, None, None, "test")


def _calibration(tmp_path: Path, devices: dict[str, tuple[int, int]]):
    exchange, sender, receiver, script = _exchange(timeout=1.0)
    book = DeviceBook(
        Registry(tmp_path / "devices.sqlite"), PRESET, CACHE, federation=FED, rounds=5, reply=lambda d, m: None
    )
    for device, (budget, samples) in devices.items():
        book.on_presence(Presence(federation=FED, round=0, device=device, state="online"))
        book.on_register(
            Register.for_client(
                federation=FED,
                device_id=device,
                host=device,
                instance="i",
                preset=PRESET,
                budget_macs=budget,
                samples=samples,
                profile={},
            )
        )
    sent: dict[str, tuple[Calibrate, bytes]] = {}
    original = exchange.send

    def send(device, message, payload, info, expect, also=()):
        sent[device] = (parse(message.encode()), payload)
        return original(device, message, payload, info, expect, also)

    exchange.send = send  # type: ignore[method-assign]
    return FederatedCalibration(exchange, book, PRESET, CACHE, calibration=40), sent, receiver, script


def test_each_variant_is_calibrated_on_the_devices_that_can_run_it_and_liars_are_left_out(tmp_path: Path) -> None:
    budgets = {"pi": (int(SMALL.macs), 60), "gpu": (int(LARGE.macs), 200), "nan": (int(LARGE.macs), 100)}
    budgets["greedy"] = (int(LARGE.macs), 50)
    calibration, sent, receiver, script = _calibration(tmp_path, budgets)
    model = Supernet(PRESET, seed=0)
    variants = {e.arch: extract(model, e.arch) for e in (SMALL, LARGE)}
    data = {"pi": _client("pi", 60, 1), "gpu": _client("gpu", 200, 2), "nan": _client("nan", 100, 3)}
    data["greedy"] = _client("greedy", 50, 4)
    answers: dict[str, bytes] = {}

    def answer(device: str, samples: int | None = None, poison: bool = False) -> None:
        message, payload = sent[device]
        blob, examples = answer_calibration(message, payload, data[device], PRESET)
        if poison:  # a hostile device: the right layout, a NaN in it
            archs = message.variant_archs(message.client_plan(PRESET))
            stats = decode_statistics(blob, [layer_channels(variants[a]) for a in archs], 10**6)[1]
            next(iter(stats[0].values()))[0][0] = float("nan")
            blob = encode_statistics(stats, examples)
        answers[device] = blob
        routed = message.transfer_info()
        update, done = _upload(device, routed, blob, samples=samples or data[device].samples)
        calibration.exchange.on_update(update)
        receiver.results.put(done)

    script.steps = [
        lambda: answer("pi"),
        lambda: answer("gpu"),
        lambda: answer("nan", poison=True),  # rejected: non-finite statistics
        lambda: answer("greedy", samples=10**6),  # refused by the exchange: more than the 50 it registered
    ]
    combined = calibration.calibrate(6, model.state_dict(), variants)
    # The smallest variant was asked of everyone, the largest only of the devices whose budget admits it.
    assert [len(sent[d][0].variants) for d in ("pi", "gpu")] == [1, 2]
    assert combined[SMALL.arch].devices == ("gpu", "pi") and combined[LARGE.arch].devices == ("gpu",)
    assert combined[SMALL.arch].examples == 40 + 40
    # Weighted by the devices' training examples (200 and 60), exactly the law of total variance.
    layers = [layer_channels(variants[SMALL.arch])]
    pi = decode_statistics(answers["pi"], layers, 60)[1][0]
    gpu = decode_statistics(answers["gpu"], layers + [layer_channels(variants[LARGE.arch])], 200)[1][0]
    expected = combine_statistics([(60.0, pi), (200.0, gpu)])
    for name, (mean, var) in combined[SMALL.arch].stats.items():
        assert torch.allclose(mean, expected[name][0]) and torch.allclose(var, expected[name][1])


def test_a_variant_no_device_answers_for_is_left_to_the_devices(tmp_path: Path) -> None:
    calibration, sent, _, script = _calibration(tmp_path, {"pi": (int(SMALL.macs), 60)})
    model = Supernet(PRESET, seed=0)
    combined = calibration.calibrate(3, model.state_dict(), {SMALL.arch: extract(model, SMALL.arch)})
    assert list(sent) == ["pi"] and combined == {}  # it never answered: no statistics, nothing invented
