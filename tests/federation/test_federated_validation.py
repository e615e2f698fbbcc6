"""The server's side of federated validation (server/validation.py) over a real round exchange, with scripted devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.protocol import Evaluate, Evaluated, Register
from feast_edge.run.loop import RoundRecord
from feast_edge.server.devices import DeviceBook
from feast_edge.server.registry import Registry
from feast_edge.server.validation import FederatedValidation
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.messages import Presence, parse
from tests.federation.test_exchange import FED, _exchange

PRESET = load_preset("fmnist-small")
CACHE = load_cache(PRESET)


def _validator(tmp_path: Path, devices: dict[str, tuple[int, ...]], rule: str = "median"):
    """A validator over a real exchange (scripted network) and a registry with ``devices``: id -> (budget, holdout)
    or (budget, holdout, evaluation limit)."""
    exchange, sender, receiver, script = _exchange(
        timeout=10.0
    )  # a deadline no loaded machine misses: every device answers
    book = DeviceBook(
        Registry(tmp_path / "devices.sqlite"), PRESET, CACHE, federation=FED, rounds=5, reply=lambda d, m: None
    )
    for device, (budget, holdout, *evaluate) in devices.items():
        book.on_presence(Presence(federation=FED, round=0, device=device, state="online"))
        book.on_register(
            Register.for_client(
                federation=FED,
                device_id=device,
                host=device,
                instance="i",
                preset=PRESET,
                budget_macs=budget,
                samples=100,
                profile={},
                holdout=holdout,
                evaluate_macs=evaluate[0] if evaluate else 0,
            )
        )
    state = Supernet(PRESET, seed=0).state_dict()
    validator = FederatedValidation(exchange, book, PRESET, CACHE, state, probes=3, calibration=50, rule=rule)
    return validator, sender, script


def _answering(validator: FederatedValidation) -> tuple[dict[str, Evaluate], object]:
    """What the validator sent each device, and ``answer(device, counts)`` that replies to it."""
    sent: dict[str, Evaluate] = {}
    original = validator.exchange.send

    def send(device, message, payload, info, expect, also=()):
        sent[device] = parse(message.encode())
        return original(device, message, payload, info, expect, also)

    validator.exchange.send = send  # type: ignore[method-assign]

    def answer(device: str, counts: list[tuple[int, int]]) -> None:
        validator.exchange.on_evaluated(Evaluated.of(sent[device], counts, 50))

    return sent, answer


def test_pooled_counts_combine_by_examples_and_no_device_outweighs_its_registered_holdout(tmp_path: Path) -> None:
    validator, sender, script = _validator(
        tmp_path,
        # pi is served the smallest variant, the gpus the largest: both are probes, so only the 3 probes are tested.
        {"pi": (1_500_000, 10), "gpu": (40_000_000, 30), "liar": (40_000_000, 5), "old": (40_000_000, 0)},
        rule="pooled",
    )
    sent, answer = _answering(validator)

    script.steps = [
        lambda: answer("pi", [(9, 10)]),  # it can afford the smallest probe only
        lambda: answer("gpu", [(15, 30), (24, 30), (27, 30)]),
        lambda: answer("liar", [(10**6, 10**6)] * 3),  # more than the 5 it registered: ignored
    ]
    record = RoundRecord(round=3, lr=0.1, cohort=["gpu", "liar", "old", "pi"])
    accuracy = validator(2, record)
    # "old" registered no held-out split (an older agent, or --holdout 0): it is not asked.
    assert sorted(sent) == ["gpu", "liar", "pi"] and [len(sent[d].probes) for d in ("pi", "gpu")] == [1, 3]
    assert record.validation["devices"] == ["gpu", "pi"] and record.validation["samples"] == 40
    assert accuracy == pytest.approx(((9 + 15) / 40 + 24 / 30 + 27 / 30) / 3)
    assert record.validation["points"]["variant 0"] == pytest.approx(24 / 40)


def test_the_median_of_the_devices_is_not_moved_by_a_liar_and_names_it(tmp_path: Path) -> None:
    devices = {d: (40_000_000, 30) for d in ("ann", "bob", "cat", "mallory")}
    validator, _, script = _validator(tmp_path, devices)
    sent, answer = _answering(validator)
    script.steps = [
        lambda: answer("ann", [(12, 30), (15, 30), (18, 30)]),
        lambda: answer("bob", [(11, 30), (14, 30), (17, 30)]),
        lambda: answer("cat", [(13, 30), (16, 30), (19, 30)]),
        lambda: answer("mallory", [(30, 30)] * 3),  # issue 35: all right in round 1, to have round 1 chosen
    ]
    record = RoundRecord(round=1, lr=0.1, cohort=sorted(devices))
    accuracy = validator(0, record)
    # Four votes: the middle two are honest (ann's and cat's), so the liar moves the figure only inside their range.
    assert accuracy == pytest.approx((12.5 / 30 + 15.5 / 30 + 18.5 / 30) / 3)
    assert record.validation["rule"] == "median"
    assert list(record.validation["flagged"]) == ["mallory"]


def test_each_device_reports_its_served_variant_for_the_served_round(tmp_path: Path) -> None:
    validator, _, script = _validator(tmp_path, {"ann": (40_000_000, 30), "mallory": (40_000_000, 30)})
    sent, answer = _answering(validator)
    script.steps = [lambda: answer("ann", [(12, 30)] * 3), lambda: answer("mallory", [(30, 30)] * 3)]
    record = RoundRecord(round=1, lr=0.1, cohort=["ann", "mallory"])
    assert validator(0, record) == pytest.approx((0.4 + 1.0) / 2)
    served = f"variant {CACHE.entries.index(CACHE.largest_affordable(40_000_000))}"
    assert record.validation["served"] == {"ann": [served, 12, 30], "mallory": [served, 30, 30]}


def test_without_a_device_that_holds_out_there_is_no_validation(tmp_path: Path) -> None:
    validator, sender, _ = _validator(tmp_path, {"old": (6_000_000, 0)})
    assert validator(0, RoundRecord(round=1, lr=0.1, cohort=["old"])) is None and sender.sent == []
    assert torch.is_tensor(next(iter(validator.global_state.values())))


def test_served_variants_are_validated_beside_the_probes_by_every_device_that_may_evaluate_them(tmp_path: Path) -> None:
    # "small" serves variant 6 (5.92M MACs) but may evaluate up to 40M (memory allowing); "fixed" may not.
    devices = {"small": (6_000_000, 10, 40_000_000), "fixed": (6_000_000, 10), "big": (40_000_000, 30)}
    validator, _, script = _validator(tmp_path, devices)
    sent, answer = _answering(validator)
    labels = [f"variant {CACHE.entries.index(e)}" for e in validator.targets()]
    assert labels == ["variant 0", "variant 6", "variant 12", "variant 25"]  # probes 0, 12, 25 and the served 6
    script.steps = [
        lambda: answer("small", [(5, 10), (6, 10), (7, 10), (2, 10)]),  # the largest knows few of its classes
        lambda: answer("fixed", [(5, 10), (6, 10)]),
        lambda: answer("big", [(20, 30), (21, 30), (24, 30), (27, 30)]),
    ]
    record = RoundRecord(round=1, lr=0.1, cohort=sorted(devices))
    accuracy = validator(0, record)
    assert [len(sent[d].probes) for d in ("small", "fixed", "big")] == [4, 2, 4]
    # The round's figure is the probes' only, as before: variant 0's median (12 and 25 have two testers, fewer than
    # MIN_SELECTING); the served variant 6's point (three testers) is beside it, not in it.
    assert accuracy == pytest.approx(0.5)
    assert record.validation["points"]["variant 25"] == pytest.approx((0.2 + 0.9) / 2)
    assert record.validation["points"]["variant 6"] == pytest.approx(0.6)
    assert record.validation["tested_by"]["variant 25"] == ["big", "small"]
    assert record.validation["tested_by"]["variant 6"] == ["big", "fixed", "small"]
