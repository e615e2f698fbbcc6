"""Secure aggregation per routed segment (feast_edge.secagg): fixed point, masks that cancel, Shamir thresholds,
dropouts at each stage, forged shares, and sums equal to the plain per-segment sums of the same encoded inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feast_edge.aggregate.segments import _index, apply_sums, plain_sums, segments_of
from feast_edge.privacy.settings import DpSettings
from feast_edge.run.sums import Summed
from feast_edge.secagg.collector import InProcessSecureSums, in_process_secure_sums
from feast_edge.secagg.fixed import FixedPoint, FixedPointError
from feast_edge.secagg.keys import ShareError, join_seed, new_seed, split_seed
from feast_edge.secagg.protocol import Device, SecAggError, Setup, threshold_for, unmasked_sums
from feast_edge.secagg.sums import plain_values, secure_sums
from feast_edge.settings.concerns import SecureAggregation
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config


def _round(setup: Setup, inputs: dict, drop_after_sharing=(), drop_after_masking=(), tamper=None, lie=None):
    """The four stages over in-process devices; the server's unmasked sums and the devices."""
    devices = {
        name: Device(name, setup, inputs.get(name, {}))
        for name in sorted({m for ms, _ in setup.segments.values() for m in ms})
    }
    roster = {name: d.advertise() for name, d in devices.items()}
    sealed = {name: d.share(roster) for name, d in devices.items()}
    commitments = {name: d.commitments() for name, d in devices.items()}
    shared = [n for n in devices if n not in drop_after_sharing]
    for name in shared:
        inbox = {sender: sealed[sender][name] for sender in shared if name in sealed[sender]}
        if tamper is not None:
            inbox = tamper(name, inbox)
        assert devices[name].receive(inbox) == []
    masked = {n: devices[n].mask(shared) for n in shared if n not in drop_after_masking}
    revealed = {n: devices[n].unmask(sorted(masked)) for n in masked}
    if lie is not None:
        revealed = lie(revealed)
    return unmasked_sums(setup, roster, shared, masked, revealed, commitments), devices


def test_fixed_point_sums_exactly_within_its_range_and_refuses_a_range_it_cannot_hold() -> None:
    code = FixedPoint.for_sum(10, 64.0)
    values = np.random.default_rng(0).uniform(-64, 64, size=(10, 1000))
    total = np.zeros(1000, dtype=np.uint32)
    for row in values:
        total += code.encode(row)
    assert np.abs(code.decode(total) - values.sum(0)).max() <= 10 * code.resolution / 2 + 1e-12
    assert code.decode(code.encode(np.array([1e9])))[0] == 64.0  # clipped to the bound before encoding
    with pytest.raises(FixedPointError, match="lower the clipping bound"):
        FixedPoint.for_sum(1000, 1e6)


def test_shamir_shares_rebuild_a_seed_at_the_threshold_and_not_below() -> None:
    seed = new_seed()
    shares = split_seed(seed, 3, 5)
    assert join_seed(shares[2:], 3) == seed and join_seed([shares[0], shares[4], shares[2]], 3) == seed
    with pytest.raises(ShareError, match="2 shares of a seed that needs 3"):
        join_seed(shares[:2], 3)
    assert threshold_for(5, 1) == 3 and threshold_for(2, 1) == 2


def test_pair_masks_cancel_and_the_sum_is_exact_while_each_masked_input_hides_its_device() -> None:
    names = ("a", "b", "c", "d")
    setup = Setup("lab/r0", {"all": (names, 6)}, threshold=3, min_members=3)
    rng = np.random.default_rng(1)
    inputs = {n: {"all": rng.integers(0, 2**32, size=6, dtype=np.uint32)} for n in names}
    sums, devices = _round(setup, inputs)
    expected = np.zeros(6, dtype=np.uint32)
    for n in names:
        expected += inputs[n]["all"]
    assert np.array_equal(sums["all"], expected)
    y = devices["a"].mask(list(names))["all"]  # what the server and the broker see of a
    assert not np.array_equal(y, inputs["a"]["all"])
    # The server and one colluder (c = 1) hold one share of a's self-mask seed: below t, it cannot be rebuilt.
    colluder = devices["b"].held["a"]
    with pytest.raises(ShareError, match="1 shares of a seed that needs 3"):
        join_seed([(colluder["index"], colluder["b"]["all"])], setup.threshold)


def test_a_device_that_drops_after_sharing_or_after_masking_costs_only_its_own_input() -> None:
    names = ("a", "b", "c", "d", "e")
    setup = Setup("lab/r1", {"all": (names, 4)}, threshold=3, min_members=3)
    inputs = {n: {"all": np.full(4, i + 1, dtype=np.uint32)} for i, n in enumerate(names)}
    sums, _ = _round(setup, inputs, drop_after_sharing=("e",))  # its pair masks never entered
    assert sums["all"].tolist() == [1 + 2 + 3 + 4] * 4
    sums, _ = _round(setup, inputs, drop_after_masking=("d", "e"))  # their pair masks are rebuilt and removed
    assert sums["all"].tolist() == [1 + 2 + 3] * 4
    with pytest.raises(SecAggError, match="fewer than t = 3"):
        _round(setup, inputs, drop_after_masking=("c", "d", "e"))  # 2 survivors: below t, no device reveals a share


def test_a_lying_revealer_is_outvoted_and_a_seed_no_subset_rebuilds_withholds_its_segment_with_the_reason() -> None:
    names = ("a", "b", "c", "d", "e")
    setup = Setup("lab/r6", {"all": (names, 4)}, threshold=3, min_members=3)
    inputs = {n: {"all": np.full(4, i + 1, dtype=np.uint32)} for i, n in enumerate(names)}

    def flip(share: bytes) -> bytes:
        return bytes([share[0] ^ 1]) + share[1:]

    def one_liar(revealed):  # e reveals a wrong share of a's self-mask seed and of d's key (d dropped)
        revealed["e"]["a"]["b"]["all"] = flip(revealed["e"]["a"]["b"]["all"])
        revealed["e"]["d"]["s"] = flip(revealed["e"]["d"]["s"])
        return revealed

    sums, _ = _round(setup, inputs, drop_after_masking=("d",), lie=one_liar)
    assert sums["all"].tolist() == [1 + 2 + 3 + 5] * 4  # the commitment and d's public key name the wrong shares

    def two_liars(revealed):  # of the four revealers, b and e lie about a's seed: no 3 honest shares remain
        for liar in ("b", "e"):
            revealed[liar]["a"]["b"]["all"] = flip(revealed[liar]["a"]["b"]["all"])
        return revealed

    sums, _ = _round(setup, inputs, drop_after_masking=("d",), lie=two_liars)
    assert sums["all"] == "the shares of a's self-mask seed do not rebuild the seed it committed to"

    def borrowed_index(revealed):  # e reveals its share of a's seed under b's index, to crowd b's out: not used
        revealed["e"]["a"]["index"] = revealed["b"]["a"]["index"]
        return revealed

    sums, _ = _round(setup, inputs, drop_after_masking=("d",), lie=borrowed_index)
    assert sums["all"].tolist() == [1 + 2 + 3 + 5] * 4


def test_a_segment_with_fewer_than_c_plus_2_surviving_members_is_never_unmasked() -> None:
    setup = Setup("lab/r2", {"small": (("a", "b"), 3), "big": (("a", "b", "c"), 3)}, threshold=2, min_members=3)
    inputs = {n: {"small": np.ones(3, dtype=np.uint32), "big": np.ones(3, dtype=np.uint32)} for n in "ab"}
    inputs["c"] = {"big": np.ones(3, dtype=np.uint32)}
    sums, devices = _round(setup, inputs)
    assert sums["small"] == "only 2 devices of the round train it; a sum is revealed over at least 3"  # never masked
    assert sums["big"].tolist() == [3, 3, 3]
    assert "small" not in devices["a"].mask(["a", "b", "c"])
    # One of big's members drops after masking: big falls below 3 survivors and its self-mask shares stay hidden.
    sums, _ = _round(setup, inputs, drop_after_masking=("c",))
    assert sums["big"] == "2 of its 3 devices masked it; at least 3 must"


def test_a_forged_share_is_named_and_a_request_that_would_unmask_a_device_twice_is_refused() -> None:
    names = ("a", "b", "c")
    setup = Setup("lab/r3", {"all": (names, 2)}, threshold=2, min_members=3)
    devices = {n: Device(n, setup, {"all": np.zeros(2, dtype=np.uint32)}) for n in names}
    roster = {n: d.advertise() for n, d in devices.items()}
    sealed = {n: d.share(roster) for n, d in devices.items()}
    forged = bytearray(sealed["b"]["a"])
    forged[-1] ^= 1
    assert devices["a"].receive({"b": bytes(forged), "c": sealed["c"]["a"]}) == ["b"]
    devices["a"].mask(["a", "c"])
    with pytest.raises(SecAggError, match="had not shared keys"):
        devices["a"].unmask(["a", "b", "c"])  # b never shared: the server cannot ask for its shares


def test_secure_sums_equal_the_plain_per_segment_sums_of_the_same_encoded_inputs() -> None:
    # Three devices of nested budgets over one 4x6 weight and a bias: the segments of method §6.
    torch.manual_seed(0)
    global_state = {"w": torch.zeros(4, 6), "b": torch.zeros(4)}
    boxes = {"big": (4, 6), "mid": (3, 4), "small": (2, 2)}
    states = {c: {"w": torch.randn(*box), "b": torch.randn(box[0])} for c, box in boxes.items()}
    weights = {"big": 3.0, "mid": 2.0, "small": 1.0}
    reference = plain_sums(global_state, [(c, states[c], weights[c]) for c in sorted(states)])
    code = FixedPoint.for_sum(3, 16.0)
    segments = segments_of(global_state, {c: {n: tuple(t.shape) for n, t in s.items()} for c, s in states.items()})
    layout = {}
    inputs: dict[str, dict[str, np.ndarray]] = {c: {} for c in states}
    for k, segment in enumerate(segments):
        sid = f"s{k}"
        parts = [(name, cell) for name, cells in segment.cells.items() for cell in cells]
        layout[sid] = (segment, parts)
        for c in segment.members:
            flat = np.concatenate([(weights[c] * states[c][n][_index(cell)]).flatten().numpy() for n, cell in parts])
            inputs[c][sid] = code.encode(flat)
    lengths = {
        sid: sum(int(np.prod([b - a for a, b in cell])) for _, cell in parts) for sid, (_, parts) in layout.items()
    }
    setup = Setup("lab/r4", {sid: (seg.members, lengths[sid]) for sid, (seg, _) in layout.items()}, 2, 1)
    sums, _ = _round(setup, inputs)
    for sid, (segment, parts) in layout.items():
        exact = np.zeros(lengths[sid], dtype=np.uint32)
        for c in segment.members:
            exact += inputs[c][sid]
        assert np.array_equal(sums[sid], exact)  # the secure sum is the plain sum of the encoded inputs
        want = next(r for r in reference.sums if r.segment.members == segment.members)
        flat = np.concatenate([v.flatten().numpy() for name in want.values for v in want.values[name]])
        ours = code.decode(sums[sid])
        order = np.concatenate([want.values[n][segment.cells[n].index(cell)].flatten().numpy() for n, cell in parts])
        assert np.abs(ours - order).max() <= len(segment.members) * code.resolution + 1e-6  # float32 products
        assert flat.size == ours.size


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
def test_a_secure_round_releases_the_model_the_plain_round_does_within_the_fixed_point_resolution(
    fashion_mnist_dir, tmp_path
) -> None:
    # One round of 3 clients; c = 0: every segment of at least 2 clients is revealed, so they match but for rounding.
    config = tiny_config(fashion_mnist_dir, rounds=1, seed=5, per_round=3, clients=3)
    plain = Simulation(config, tmp_path / "plain")
    plain.run()
    secure = Simulation(config.changed(secure_agg=True, colluders=0), tmp_path / "secure")
    secure.run()
    [ours], [theirs] = secure.loop.history, plain.loop.history
    assert (
        ours.applied and ours.updated == theirs.updated and (ours.samples, ours.loss) == (theirs.samples, theirs.loss)
    )
    single = {members for members in ours.withheld}  # segments routed to one client only: withheld even at c = 0
    assert all("," not in members for members in single), ours.withheld
    for members, reason in ours.withheld.items():
        assert reason == "only 1 device of the round trains it; a sum is revealed over at least 2", (members, reason)
    transport = secure.collector.transport
    assert isinstance(secure.collector, Summed) and isinstance(transport, InProcessSecureSums)
    assert transport.clipped == 0 and transport.clip is None  # no DP: nothing clipped before masking
    released, reference = secure.model.state_dict(), plain.model.state_dict()
    before = Simulation(config, tmp_path / "init").model.state_dict()
    # Every value equals the plain round's (to the fixed-point resolution) or, in a withheld segment, its initial one.
    for name, tensor in reference.items():
        if tensor.is_floating_point():
            as_plain = torch.isclose(released[name], tensor, rtol=0, atol=1e-5)
            assert torch.equal(released[name][~as_plain], before[name][~as_plain]), name
    assert any(
        not torch.equal(released[n], before[n]) for n in released if released[n].is_floating_point()
    )  # and the round did move the model


def test_each_client_uploads_its_masked_segments_plus_one_weight_each_and_nothing_of_a_withheld_one() -> None:
    global_state = {"w": torch.zeros(4, 6), "b": torch.zeros(4)}
    boxes = {"big": (4, 6), "mid": (3, 4), "small": (2, 2)}
    states = {c: {"w": torch.full(box, 0.5), "b": torch.full((box[0],), 0.5)} for c, box in boxes.items()}
    updates = [(c, states[c], 10.0) for c in sorted(states)]
    done = secure_sums(global_state, updates, colluders=0)
    assert set(done.withheld) == {"big"}  # the positions only big trains: one device, never revealed
    plain = plain_values(updates)
    only_big = 4 * 6 - 3 * 4 + 4 - 3  # w and b values routed to big alone
    assert done.upload_values == {
        "big": plain["big"] - only_big + 2,
        "mid": plain["mid"] + 2,
        "small": plain["small"] + 1,
    }
    # θ_t + mean change on every revealed value; the withheld ones keep θ_t = 0.
    released = {n: t.clone() for n, t in global_state.items()}
    apply_sums(released, done.sums)
    assert torch.allclose(released["w"][:3, :4], torch.full((3, 4), 0.5), atol=1e-6)
    assert torch.equal(released["w"][3], torch.zeros(6)) and torch.equal(released["w"][:, 4:], torch.zeros(4, 2))


def test_secure_aggregation_refuses_what_needs_each_client_s_update(fashion_mnist_dir) -> None:
    from feast_edge.sim.setup import SimulationError

    for changes, named in (
        ({"mode": "async", "buffer": 2, "concurrency": 2}, "--mode async"),
        ({"aggregation": "median"}, "--aggregation median"),
        ({"server_opt": "adam"}, "--server-opt adam"),
        ({"max_weight_ratio": 4.0}, "--max-weight-ratio"),
        ({"dp_mode": "local", "dp_clip": 1.0, "dp_noise": 0.5, "dp_epsilon": 1e9}, "--dp-mode local"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_clip_quantile": 0.5, "dp_epsilon": 1e9}, "--dp-clip-quantile"),
        ({"colluders": 2, "secagg_neighbours": 4}, "--secagg-neighbours 4 must be 0 .* or at least 2 · --colluders"),
    ):
        with pytest.raises(SimulationError, match=named):
            tiny_config(fashion_mnist_dir, secure_agg=True, **changes)


def test_what_the_server_and_one_colluder_see_of_a_round_does_not_give_a_single_device_s_input() -> None:
    """Everything the server (and the broker) saw of a round — public keys, sealed shares, masked inputs, the revealed
    shares — plus everything colluder c holds: the best reconstruction of an honest device's input fails at c + 2 = 3
    members, and succeeds when the segment is let through with 2 (why segments of fewer than c + 2 stay masked)."""
    from feast_edge.secagg.keys import agree, expand

    def attack(min_members: int) -> bool:
        names = ("a", "b", "c")  # c colludes with the server; a is the target
        setup = Setup("lab/r5", {"all": (names, 5)}, threshold=2, min_members=min_members)
        rng = np.random.default_rng(7)
        inputs = {n: {"all": rng.integers(0, 2**32, size=5, dtype=np.uint32)} for n in names}
        devices = {n: Device(n, setup, inputs[n]) for n in names}
        roster = {n: d.advertise() for n, d in devices.items()}
        sealed = {n: d.share(roster) for n, d in devices.items()}
        for n, d in devices.items():
            d.receive({s: boxes[n] for s, boxes in sealed.items() if s != n})
        shared = list(names) if min_members == 3 else ["a", "c"]  # with 2: b dropped before masking
        masked = {n: devices[n].mask(shared) for n in shared}
        revealed = {n: devices[n].unmask(sorted(masked)) for n in masked}
        # The server's view: y_a, the revealed shares of a's self-mask seed; the colluder's: its s key.
        shares = [(r["a"]["index"], r["a"]["b"]["all"]) for r in revealed.values() if "all" in r["a"].get("b", {})]
        guess = masked["a"]["all"] - expand(join_seed(shares, setup.threshold), 5, "lab/r5/all")
        colluder = devices["c"]
        pair = expand(agree(colluder.s_key, roster["a"][1], "pair", "lab/r5/all"), 5, "lab/r5/all")
        guess = guess - pair  # a added +PRG(s_ac) (a < c): the colluder knows it
        return np.array_equal(guess, inputs["a"]["all"])

    assert not attack(min_members=3)  # b's pair mask with a stays: a's input is hidden
    assert attack(min_members=2)  # a segment of a and the colluder alone would give a away


def test_with_a_neighbour_graph_each_device_shares_with_k_others_and_the_sums_stay_exact_through_dropouts() -> None:
    """SecAgg+ (k = 4) over 12 devices in two nested segments: each device masks with 4 members of each segment and
    seals shares for 4 devices, not 11; dropouts after sharing and after masking cost only the dropped inputs."""
    from feast_edge.secagg.protocol import circulant, degree_for

    names = tuple(f"d{i:02d}" for i in range(12))
    setup = Setup("lab/r7", {"all": (names, 3), "top": (names[:5], 2)}, threshold=3, min_members=3, degree=4)
    graph = circulant(names, 4, "lab/r7/all")
    assert all(len(v) == 4 and all(u in graph[w] for w in v) for u, v in graph.items())  # 4-regular, symmetric
    assert all(len(setup.holders(n)) == 5 and setup.threshold_of(n) == 3 for n in names)
    assert setup.neighbours("d00", "top") == frozenset(names[1:5])  # 5 members, at most k + 1: all the others
    inputs = {n: {"all": np.full(3, i + 1, dtype=np.uint32)} for i, n in enumerate(names)}
    for n in names[:5]:
        inputs[n]["top"] = np.full(2, 100, dtype=np.uint32)
    sums, devices = _round(setup, inputs)
    assert sums["all"].tolist() == [sum(range(1, 13))] * 3 and sums["top"].tolist() == [500] * 2
    assert all(len(d.held) == 5 for d in devices.values())  # its own share and four others'
    sums, _ = _round(setup, inputs, drop_after_sharing=("d03",), drop_after_masking=("d07",))
    # d03 left before U2, d07 before its masked input came: their pair masks are rebuilt from 3 of their 4 holders
    assert sums["all"].tolist() == [sum(range(1, 13)) - 4 - 8] * 3
    assert sums["top"].tolist() == [400] * 2
    assert degree_for(10) == 0 and degree_for(100) == 14 and degree_for(100, 6) == 6 and degree_for(7, 6) == 0


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
def test_central_dp_on_secure_sums_releases_the_plain_dp_round_within_the_fixed_point_resolution(
    fashion_mnist_dir, tmp_path
) -> None:
    """--dp-mode central with --secure-agg: each device clips its parameters' change before masking (weight 1) and
    the server adds the noise to the unmasked sums. With the same noise seed the released model is the plain DP
    round's, but for rounding, on every segment of at least c + 2 = 2 clients; a withheld segment keeps θ_t (and no
    noise: no data touched it)."""
    dp = dict(dp_mode="central", dp_clip=0.5, dp_noise=0.8, dp_seed=11, dp_epsilon=1e9)
    config = tiny_config(fashion_mnist_dir, rounds=1, seed=5, per_round=3, clients=3, **dp)
    plain = Simulation(config, tmp_path / "plain")
    plain.run()
    secure = Simulation(config.changed(secure_agg=True, colluders=0), tmp_path / "secure")
    secure.run()
    [ours], [theirs] = secure.loop.history, plain.loop.history
    assert ours.applied and ours.dp == theirs.dp  # the same accounting: the same ε after the round
    assert secure.collector.transport.clip == 0.5  # every device clipped to --dp-clip before masking
    released, reference = secure.model.state_dict(), plain.model.state_dict()
    before = Simulation(config, tmp_path / "init").model.state_dict()
    moved = 0
    for name, tensor in reference.items():
        if tensor.is_floating_point():
            as_plain = torch.isclose(released[name], tensor, rtol=0, atol=1e-5)
            assert torch.equal(released[name][~as_plain], before[name][~as_plain]), name
            moved += int((as_plain & (tensor != before[name])).sum())
    assert moved > 0  # the round moved the model, noise included, as the plain DP round did


@pytest.mark.parametrize(
    ("dp", "clip"),
    [(None, None), (DpSettings(0.5, 0.8, mode="local"), None), (DpSettings(0.5, 0.8), 0.5)],
    ids=["no-dp", "local-dp", "central-dp"],
)
def test_devices_clip_before_masking_only_under_central_dp_and_no_clip_is_none(dp, clip) -> None:
    secure = SecureAggregation(secure_agg=True, colluders=2, secagg_bound=4.0, secagg_neighbours=6)
    summed = in_process_secure_sums(object(), secure, dp, {"w"})  # type: ignore[arg-type]  # any inner collector
    transport = summed.transport
    assert type(summed) is Summed and isinstance(transport, InProcessSecureSums)
    assert transport.clip == clip  # None, never 0.0, without central DP
    assert (transport.terms.colluders, transport.terms.bound, transport.terms.neighbours) == (2, 4.0, 6)


def test_without_pycryptodome_only_secure_rounds_stop_and_they_name_the_fix() -> None:
    """An agent installed without PyCryptodome still imports (its secure-aggregation side included) and runs plain
    rounds; sharing a seed, the first thing a secure round needs of it, says what to install. In a fresh interpreter
    where PyCryptodome cannot be imported."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['Crypto'] = None; sys.modules['Crypto.Protocol.SecretSharing'] = None\n"
        "import feast_edge.agent.agent, feast_edge.agent.secure_round\n"
        "from feast_edge.errors import FeastError\n"
        "from feast_edge.secagg.keys import split_seed\n"
        "try:\n    split_seed(bytes(16), 2, 3)\nexcept FeastError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs PyCryptodome for Shamir secret sharing: pip install pycryptodome" in done.stdout
