"""Secure aggregation over a real Mosquitto (feast-server run --secure-agg; server.secure, agent.secure_round): real
agents key, share, mask and unmask; the server's unmasked sums equal the plain sums of the inputs the devices encoded,
when devices drop after masking, and the server never holds one device's update."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from slowagents import agents_running
from test_federation_failures import PRESET, ScriptedDevice, scripted_server, shifted

import feast_edge.agent.secure_round as agent_side
import feast_edge.server.secure as server_side
from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.local_data import load_clients
from feast_edge.aggregate.released import variant_shapes
from feast_edge.privacy.local import parameter_names
from feast_edge.privacy.mechanism import add_sum_noise, noise_generator
from feast_edge.protocol import SecAggBox, SecAggKeys, SecAggReveal, SecAggRoster, SecAggShares, SecAggUnmask, Update
from feast_edge.protocol.secure import sealed_wire
from feast_edge.route.payload import expected_shapes
from feast_edge.route.plans import ClientPlan, plan_client
from feast_edge.run.checkpoint import load_supernet
from feast_edge.secagg.fixed import FixedPoint
from feast_edge.secagg.keys import ShareError, agree, expand, join_seed
from feast_edge.secagg.masked import encode_masked
from feast_edge.secagg.protocol import Device
from feast_edge.secagg.sums import SecureTerms, cohort_segments, dp_input, encode_change
from feast_edge.server.collect import RoundTerms
from feast_edge.server.status import read_status
from feast_edge.sim.shards import write_partition
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import describe
from simconfigs import tiny_config

pytestmark = [pytest.mark.broker]

SIX = tiny_config(clients=6, per_round=6, train_limit=360, test_limit=60, probe_variants=2, seed=5)


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("six")
    write_partition(SIX, out)
    return out


def _agents(kit, partition: Path, federation: str, names: list[str]) -> list[Agent]:
    return [
        Agent(
            AgentConfig(host=n, federation=federation, preset=SIX.preset, threads=1, amp="off"),
            LinkConfig(broker=kit.LOCAL),
            load_clients(partition / f"{n}.safetensors", n),
        )
        for n in names
    ]


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
@pytest.mark.parametrize("neighbours", [0, 4], ids=["every-pair", "secagg-plus-k4"])
def test_six_agents_with_two_dropping_after_masking_release_the_survivors_exact_sums_and_never_one_update(
    kit, tmp_path: Path, six: Path, federation: str, monkeypatch: pytest.MonkeyPatch, neighbours: int
) -> None:
    names = [f"client-{i:03d}" for i in range(6)]
    dropping = set(names[1:3])  # 2 of 6 (33 %) mask, upload, and go away before the unmask request
    encoded: dict[str, dict[str, np.ndarray]] = {}  # what each device encoded, read from its party (test only)
    unmasked: list[dict] = []
    real_upload, real_reveal, real_sums = (
        agent_side.SecureRounds.masked_upload,
        agent_side.SecureRounds._reveal,
        server_side.unmasked_sums,
    )

    parties: dict = {}

    def upload(self, start, base, state, deadline, abandon):
        blob = real_upload(self, start, base, state, deadline, abandon)
        parties[start.device] = party = self._parties[start.transfer["transfer"]]
        encoded[start.device] = dict(party.device.inputs)
        return blob

    def reveal(self, party, request):
        if party.start.device in dropping:
            self.stop.set()  # the agent stops: offline, no shares
            return
        real_reveal(self, party, request)

    seen: list[tuple] = []  # everything the server held when it unmasked: keys, U2, masked uploads, shares

    def sums(*args):
        seen.append(args)
        unmasked.append(real_sums(*args))
        return unmasked[-1]

    monkeypatch.setattr(agent_side.SecureRounds, "masked_upload", upload)
    monkeypatch.setattr(agent_side.SecureRounds, "_reveal", reveal)
    monkeypatch.setattr(server_side, "unmasked_sums", sums)
    config = kit.server_config(
        SIX, tmp_path, six, federation, secure_agg=True, colluders=1, secagg_timeout=20, rounds=1, per_round=6,
        min_clients=4, start_clients=6, eval_every=1, round_timeout=240, secagg_neighbours=neighbours,
    )  # fmt: skip
    server = kit.ServerThread(config).start()
    try:
        with agents_running(_agents(kit, six, federation, names)):
            history = server.join(300)
    finally:
        server.close()
    record = history[0]
    assert record.applied and sorted(record.cohort) == names, record
    assert not record.rejected and not record.incomplete, record
    (sums,) = unmasked
    released = {s: v for s, v in sums.items() if not isinstance(v, str)}
    assert released, sums  # the segments of at least c + 2 = 3 members were unmasked
    for segment, total in released.items():
        contributors = [d for d in names if segment in encoded.get(d, {})]
        assert len(contributors) >= 3 and dropping & set(contributors) or len(contributors) >= 3
        expected = np.zeros_like(total)
        for d in contributors:
            expected += encoded[d][segment]
        assert np.array_equal(total, expected), segment  # exact: the pair masks cancel, the self-masks came off
    withheld = {s: v for s, v in sums.items() if isinstance(v, str)}
    assert all("a sum is revealed over at least 3" in why for why in withheld.values()), withheld
    assert len(record.withheld) == len(withheld)
    setup = seen[0][0]
    assert setup.degree == neighbours and all(len(setup.holders(d) or names) == (5 if neighbours else 6) for d in names)
    _no_single_update_from_what_the_server_saw(seen[0], parties, encoded, dropping)
    stage = read_status(tmp_path)["secure"]
    assert stage["stage"] == "done" and stage["round"] == 1, stage
    assert "4 of 6 devices revealed shares" in stage["detail"], stage


TIERED = tiny_config(clients=6, per_round=6, train_limit=360, test_limit=60, probe_variants=2, seed=5,
                     budgets=(0.2e6, 0.2e6, 0.2e6, 0.8e6, 1.5e6, 1.5e6))  # fmt: skip


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiered")
    write_partition(TIERED, out)
    return out


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_a_top_tier_of_two_is_routed_only_what_three_devices_reveal_and_served_a_variant_whose_every_slice_trained(
    kit,
    tmp_path: Path,
    tiered: Path,
    federation: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Six real agents (budgets 0.2M x3, 0.8M, 1.5M x2 on fmnist-tiny), c = 1, two rounds of all six: the start line
    names variants 9-13 (only the two 1.5M devices afford them); the plans sent to those two hold variants 0-8 only,
    the middle device's envelope; no segment is withheld; their ONNX model (onnxruntime) is variant 8, whose every
    weight moved, where variant 13, their largest affordable, still holds a slice at its initial value."""
    sent: list[tuple[int, str, ClientPlan]] = []
    real = RoundTerms.round_start

    def round_start(self, plan, federation, t, device, *args, **kw):
        sent.append((t, device, plan))
        return real(self, plan, federation, t, device, *args, **kw)

    monkeypatch.setattr(RoundTerms, "round_start", round_start)
    names = [f"client-{i:03d}" for i in range(6)]
    top = names[4:]
    config = kit.server_config(
        TIERED, tmp_path, tiered, federation, secure_agg=True, colluders=1, secagg_timeout=20, rounds=2, per_round=6,
        min_clients=6, start_clients=6, eval_every=2, round_timeout=240,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="feast_edge.run.stratified"):
        server = kit.ServerThread(config, export=True).start()
        try:
            with agents_running(_agents(kit, tiered, federation, names)):
                history = server.join(300)
        finally:
            server.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "feast_edge.run.stratified"]
    assert len(lines) == 1 and "variants 9-13 (0.94M-1.40M MACs) cannot be revealed: only 2 devices afford" in lines[0]
    cache, preset = server.server.cache, server.server.preset
    middle = plan_client(cache, 0.8e6)
    for t, device, plan in sent:
        assert plan.envelope == (
            middle.envelope
            if device in top
            else plan_client(cache, TIERED.population.budgets[names.index(device)]).envelope
        )
    assert {(t, d) for t, d, _ in sent if d in top} == {(0, top[0]), (0, top[1]), (1, top[0]), (1, top[1])}
    assert all(set(p.affordable) == {e.arch for e in cache.entries[:9]} for _, d, p in sent if d in top)
    assert all(r.applied and not r.withheld and sorted(r.updated) == names for r in history), history
    manifests = {m["device"]: m for m in server.manifests}
    assert all(manifests[d]["arch"] == cache.entries[8].arch.to_dict() for d in top)
    assert all(manifests[d]["largest_affordable_macs"] == cache.entries[13].macs for d in top)
    assert 8 in server.server.trained() and 13 not in server.server.trained()
    final = load_supernet(server.server.loop.selected_checkpoint(), preset)[0].state_dict()
    initial = Supernet(preset, seed=TIERED.seed).state_dict()

    def at_initial(index: int, inside: dict | None = None) -> tuple[int, int]:
        """(the variant's weights still at their initial value, its weights), outside the leading slices ``inside``."""
        same = total = 0
        for name, shape in variant_shapes(preset, cache, index).items():
            if name.endswith("weight"):
                box = tuple(slice(0, k) for k in shape)
                outside = torch.ones(shape, dtype=torch.bool)
                if inside is not None and name in inside:
                    outside[tuple(slice(0, k) for k in inside[name])] = False
                same += int((final[name][box] == initial[name][box])[outside].sum())
                total += int(outside.sum())
        return same, total

    routed_middle = expected_shapes(preset, preset.classes, middle.envelope)
    same, weights = at_initial(8)
    assert same <= weights // 1000  # the served variant's weights moved (but for a stray one that got no gradient)
    same, shell = at_initial(13, routed_middle)
    assert shell > 0 and same == shell  # its largest affordable holds a shell no release moved
    session = ort.InferenceSession(str(tmp_path / "models" / f"{top[0]}.onnx"), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0]
    logits = session.run(None, {feed.name: np.zeros((2, 1, 28, 28), dtype=np.float32)})[0]
    assert logits.shape == (2, 10) and np.isfinite(logits).all()


def _assert_moved_by(final: dict, routed: dict, mean: float) -> None:
    """Every routed floating value of the released model is the routed one plus ``mean`` (to the encoding's rounding)."""
    for name, value in routed.items():
        if value.is_floating_point():
            got = final[name][tuple(slice(0, n) for n in value.shape)]
            assert torch.allclose(got, value + mean, atol=1e-4), name


class SecureScripted(ScriptedDevice):
    """A device that runs the secure stages by hand (feast_edge.secagg.protocol.Device), and may lie at each."""

    def take_round(self) -> None:
        self.start, _, self.routed = self.next_round()
        block = self.start.secure_block()
        assert block is not None
        self.block, self.segments = block, cohort_segments(PRESET, block.cohort)
        setup = SecureTerms(block.colluders, block.bound).setup(f"{self.fed}/round {self.start.round}", self.segments,
                                                                len(block.cohort))  # fmt: skip
        self.party, self.code = Device(self.device_id, setup, {}), FixedPoint(block.bound, block.frac)

    def say(self, kind: type, *, routed: str | None = None, **fields: object) -> None:
        message = kind(federation=self.fed, round=self.start.round, device=self.device_id,
                       routed=routed or self.start.transfer["transfer"], **fields)  # fmt: skip
        self.link.publish(self.topics.events(self.device_id), message.encode(), timeout=5)

    def advertise(self) -> None:
        c_key, s_key = self.party.advertise()
        self.say(SecAggKeys, c_key=c_key.hex(), s_key=s_key.hex())

    def share(self, tamper=None) -> None:
        sealed = self.party.share(self._next(SecAggRoster).roster())
        self.say(SecAggShares, shares=sealed_wire(tamper(sealed) if tamper else sealed),
                 commitments=self.party.commitments())  # fmt: skip

    def open_box(self) -> list[str]:
        box = self._next(SecAggBox)
        self.shared = box.shared
        return self.party.receive(box.sealed())

    def masked_update(self, delta: float) -> None:
        state, me = shifted(self.routed, delta), self.device_id
        if self.block.clip:  # central DP, as an honest agent does: clip the parameters' change, the rest global
            state = dp_input(self.routed, state, parameter_names(PRESET), self.block.clip)
        self.party.inputs = {
            s: encode_change(self.segments[s], self.routed, state, self.block.weight(me), self.code)[0]
            for s in self.party.setup.routed(me)
        }
        integers = {n: t for n, t in state.items() if not t.is_floating_point()}
        blob = encode_masked(self.party.mask(self.shared), integers, self.start.round, me)
        info = describe(blob, federation=self.fed, round=self.start.round, device=me, chunk_size=64 * 1024)
        update = Update(federation=self.fed, round=self.start.round, device=me, transfer=info.to_dict(),
                        routed=self.start.transfer["transfer"], samples=50, metrics={"loss": 1.0})  # fmt: skip
        self.send(update, blob)

    def reveal(self, lie=None) -> None:
        revealed = self.party.unmask(self._next(SecAggUnmask).masked)
        self.say(SecAggReveal, shares=SecAggReveal.wire(lie(revealed) if lie else revealed))


def test_a_lying_device_s_forged_share_wrong_reveals_and_malformed_stage_messages_never_change_the_exact_sum(
    kit, tmp_path: Path, federation: str
) -> None:
    """Four provisioned devices of one budget (one segment, c = 1, t = 3); d lies at every stage. The round releases
    θ_t + the mean of the four changes, exactly as encoded: d's lies are refused or outvoted, never a crash."""
    server = scripted_server(
        kit, tmp_path, federation, 1, per_round=4, min_clients=4, start_clients=4, secure_agg=True,
        secagg_timeout=15, server_opt="avg", round_timeout=30,
    )  # fmt: skip
    names = ["a", "b", "c", "d"]
    devices = {n: SecureScripted(federation, n) for n in names}
    deltas = {"a": 0.125, "b": 0.25, "c": 0.375, "d": 0.5}
    try:
        for device in devices.values():
            assert device.register(samples=50).accepted
        for device in devices.values():
            device.take_round()
        liar = devices["d"]
        liar.say(SecAggKeys, routed="not-its-round", c_key="00" * 32, s_key="00" * 32)  # another round's: ignored
        for device in devices.values():
            device.advertise()
        raw = json.dumps({"v": 1, "kind": "secagg_shares", "federation": federation, "round": 0, "device": "d",
                          "msg_id": "f" * 32, "routed": liar.start.transfer["transfer"], "commitments": {},
                          "shares": {f"x{i}": "AA==" for i in range(65)}}).encode()  # fmt: skip
        liar.link.publish(liar.topics.events("d"), raw, timeout=5)  # 65 recipients: refused at parse

        def forge_for_a(sealed: dict) -> dict:
            sealed["a"] = bytes([sealed["a"][0] ^ 1]) + sealed["a"][1:]
            return sealed

        for name, device in devices.items():
            device.share(forge_for_a if name == "d" else None)
        assert devices["a"].open_box() == ["d"]  # a names the share it cannot open
        for name in "bcd":
            assert devices[name].open_box() == []
        for name, device in devices.items():
            device.masked_update(deltas[name])

        def lie(revealed: dict) -> dict:
            for owner in ("a", "b"):  # wrong shares of two honest devices' self-mask seeds
                seeds = revealed[owner]["b"]
                for s in seeds:
                    seeds[s] = bytes([seeds[s][0] ^ 1]) + seeds[s][1:]
            return revealed

        for name in "abc":
            devices[name].reveal()
        liar.reveal(lie)
        history = server.join(60)
        final = server.server.model.state_dict()
    finally:
        for device in devices.values():
            device.close()
        server.close()
    assert history[0].applied and not history[0].withheld and not history[0].rejected, history[0]
    _assert_moved_by(final, devices["a"].routed, sum(deltas.values()) / 4)


def _no_single_update_from_what_the_server_saw(seen: tuple, parties: dict, encoded: dict, dropping: set) -> None:
    """The named reconstructions, from every key, masked upload and revealed share the server held, alone and with
    one colluding device (c = 1): each leaves an honest device's input hidden behind another honest member's mask."""
    setup, roster, shared, masked, revealed, _ = seen
    for segment, (members, length) in setup.segments.items():
        contributors = [m for m in members if segment in masked.get(m, {})]
        if len(contributors) < 3:
            continue
        context = f"{setup.context}/{segment}"
        for target in contributors:
            near = setup.neighbours(target, segment)
            colluder = next(m for m in contributors if m in near)  # the colluder that masks with the target
            shares = [(r[target]["index"], r[target]["b"][segment]) for r in revealed.values()
                      if segment in r.get(target, {}).get("b", {})]  # fmt: skip
            t = setup.threshold_of(target)
            guess = masked[target][segment] - expand(join_seed(shares, t), length, context)
            assert not np.array_equal(guess, encoded[target][segment])  # masked upload and its self-mask off
            pair = expand(agree(parties[colluder].device.s_key, roster[target][1], "pair", context), length, context)
            guess = guess - pair if target < colluder else guess + pair
            assert not np.array_equal(guess, encoded[target][segment])  # and the colluder's pair mask off
            # The colluder's share of the target's s key and the revealed ones stay below t: the key stays hidden.
            held = parties[colluder].device.held.get(target)  # with a graph it may hold none of the target's
            s_shares = [] if held is None else [(held["index"], held["s"])]
            s_shares += [(r[target]["index"], r[target]["s"]) for r in revealed.values() if "s" in r.get(target, {})]
            with pytest.raises(ShareError):
                join_seed(s_shares, t)


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
def test_a_device_that_misses_the_share_stage_is_out_of_the_round_and_the_others_release_their_exact_sum(
    kit, tmp_path: Path, federation: str
) -> None:
    """Four devices of one budget, c = 1 (t = 3): d advertises its keys and never seals its shares. At the stage's
    timeout the server takes it out of the round (its update is no longer waited for) and a, b, c go on without it."""
    server = scripted_server(
        kit, tmp_path, federation, 1, per_round=4, min_clients=3, start_clients=4, secure_agg=True,
        secagg_timeout=3, server_opt="avg", round_timeout=60,
    )  # fmt: skip
    devices = {n: SecureScripted(federation, n) for n in "abcd"}
    deltas = {"a": 0.125, "b": 0.25, "c": 0.5}
    try:
        for device in devices.values():
            assert device.register(samples=50).accepted
        for device in devices.values():
            device.take_round()
            device.advertise()
        for name in "abc":
            devices[name].share()
        for name in "abc":
            assert devices[name].open_box() == []
            assert devices[name].shared == ("a", "b", "c")  # U2: d is not in it
        for name in "abc":
            devices[name].masked_update(deltas[name])
        for name in "abc":
            devices[name].reveal()
        history = server.join(60)
        final = server.server.model.state_dict()
    finally:
        for device in devices.values():
            device.close()
        server.close()
    record = history[0]
    assert record.applied and sorted(record.updated) == ["a", "b", "c"], record
    assert "secure aggregation: it sent no sealed shares within 3 s" in record.incomplete["d"], record.incomplete
    _assert_moved_by(final, devices["a"].routed, sum(deltas.values()) / 3)


def test_central_dp_over_mqtt_noises_the_unmasked_sum_of_the_clipped_changes(
    kit, tmp_path: Path, federation: str
) -> None:
    """--secure-agg --dp-mode central: each device clips its parameters' change to C before masking (weight 1); the
    server unmasks the sum and adds N(0, z²C²) per coordinate, divided by the count: with a fixed noise seed the
    released model is exactly θ_t + (Σ clip(Δ_i) + noise) / 4, computed here from the devices' own changes."""
    server = scripted_server(
        kit, tmp_path, federation, 1, per_round=4, min_clients=4, start_clients=4, secure_agg=True,
        secagg_timeout=15, server_opt="avg", round_timeout=30, dp_clip=0.5, dp_noise=0.8, dp_seed=3, dp_epsilon=1e9,
    )  # fmt: skip
    devices = {n: SecureScripted(federation, n) for n in "abcd"}
    deltas = {"a": 0.001, "b": -0.002, "c": 0.003, "d": 0.0005}
    try:
        for device in devices.values():
            assert device.register(samples=50).accepted
        for device in devices.values():
            device.take_round()
            device.advertise()
        assert devices["a"].block.clip == 0.5 and devices["a"].block.weight("a") == 1.0
        for device in devices.values():
            device.share()
        for device in devices.values():
            assert device.open_box() == []
        for name, device in devices.items():
            device.masked_update(deltas[name])
        for device in devices.values():
            device.reveal()
        history = server.join(60)
        final = server.server.model.state_dict()
    finally:
        for device in devices.values():
            device.close()
        server.close()
    assert history[0].applied and history[0].dp["cohort"] == 4, history[0]
    initial = Supernet(PRESET, seed=0).state_dict()  # the model every device was routed (round 0's)
    params = sorted(n for n in parameter_names(PRESET) if n in initial)
    routed = devices["a"].routed
    clipped = [dp_input(routed, shifted(routed, deltas[n]), parameter_names(PRESET), 0.5) for n in "abcd"]
    expected = {n: t.clone().double() for n, t in initial.items() if n in params}
    for name in params:
        if name in routed:
            box = tuple(slice(0, k) for k in routed[name].shape)
            expected[name][box] = sum(c[name].double() for c in clipped) / 4
    counts = {n: torch.zeros(initial[n].shape, dtype=torch.float64) for n in params}
    for name in params:
        if name in routed:
            counts[name][tuple(slice(0, k) for k in routed[name].shape)] = 4
    add_sum_noise(expected, counts, 0.8 * 0.5, noise_generator(3, 0))
    for name in params:
        assert torch.allclose(final[name].double(), expected[name], atol=1e-5), name
