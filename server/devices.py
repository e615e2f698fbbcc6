"""Who is in the federation: registrations (accepted or refused, with the reason) and presence (online hosts).

The registry (``registry.py``) stores devices; this module decides on each
``register`` message and follows the retained ``status`` messages of the agent
processes (hosts) that carry them. A device id is taken while the host that
registered it with this server process is online; once that host goes offline
(or the server restarts) a new agent instance may take the id over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from feast_edge.cache.variants import VariantCache
from feast_edge.data.holdout import MAX_HOLDOUT
from feast_edge.protocol import Register, Registered
from feast_edge.server.coverage import CoverageWatch
from feast_edge.server.registry import Registry
from feast_edge.space.preset import Preset
from feast_edge.transport.messages import Presence

log = logging.getLogger(__name__)

# The most held-out examples per training example a device may register: --holdout 0.9 holds out round(0.9 n) of
# each class of n >= 2 examples and trains on the rest, at worst 14 to 1 (a class of 15).
HOLDOUT_RATIO = 16

UNANSWERED = 4  # registrations of one agent instance after it was accepted: it does not hear the answers


class DeviceBook:
    """Registration decisions and host presence over one registry."""

    def __init__(
        self,
        registry: Registry,
        preset: Preset,
        cache: VariantCache,
        *,
        federation: str,
        rounds: int,
        reply: Callable[[str, Registered], None],
        authenticated: bool = False,
        max_samples: int = 1_000_000,
        max_devices: int = 10_000,
        shard_samples: dict[str, int] | None = None,
        validation: str = "server",
    ) -> None:
        self.registry = registry
        self.preset = preset
        self.cache = cache
        self.federation = federation
        self.rounds = rounds
        self.reply = reply  # sends a Registered answer to a device
        # Provisioned: every message is signed by the identity its topic names, so a device is its own host (one identity,
        # one agent); an agent cannot register devices or hosts it holds no credentials for.
        self.authenticated = authenticated
        # The registered sample count bounds every later aggregation weight: the server's own record of a device's shard
        # (its partition) bounds it where there is one, --max-samples elsewhere.
        self.max_samples = max_samples
        self.max_devices = max_devices  # the registry (and every per-device record) stays bounded whoever registers
        self.shard_samples = shard_samples or {}
        self.task = preset.task  # announced in every answer; a device checked its data against it
        self.coverage = CoverageWatch(registry, cache, preset.task.classes)  # warns of label skew once per problem
        self.validation = validation  # "server" (server-held data) or "devices" (federated validation and calibration)
        self.finished = False  # the federation ran all its rounds: registrations are answered with finished=True
        self.hosts_online: set[str] = set()
        # Devices a new agent instance may take over: those whose host went offline since they registered, and, at a
        # (re)start, every device in the registry (no agent has registered with this server process yet, so an agent
        # that came back first replaces its own stale registration instead of being refused as a duplicate).
        self._released: set[str] = {d.device_id for d in registry.devices()}
        # Devices of the registry no agent has registered with this server process yet: their stored agent instance
        # may be stale (agents drop rounds addressed to another instance), so no round goes to them until their agent
        # registers again, which it does as soon as it sees this server come online.
        self._unconfirmed: set[str] = set(self._released)
        registry.mark_all_offline()
        self._repeats: dict[str, tuple[str, int]] = {}  # device -> (agent instance, accepted registrations it sent)

    def online(self) -> list[str]:
        """Registered devices whose host is online and whose agent registered with this server process, sorted."""
        return sorted(d.device_id for d in self.registry.devices() if self._reachable(d.device_id, d.host))

    def supports(self, device: str, feature: str) -> bool:
        """Whether ``device``'s agent listed the protocol ``feature`` when it registered (feast_edge.protocol.features)."""
        registered = self.registry.get(device)
        features = registered.profile.get("features") if registered is not None else None
        return isinstance(features, list) and feature in features

    def offline(self) -> list[str]:
        """Registered devices whose host is not online (or has not registered again since this server started), sorted."""
        return sorted(d.device_id for d in self.registry.devices() if not self._reachable(d.device_id, d.host))

    def _reachable(self, device: str, host: str) -> bool:
        return host in self.hosts_online and device not in self._unconfirmed

    def on_presence(self, message: Presence) -> list[str]:
        """Follow an agent's status; returns the devices that just went offline (a round in flight stops waiting for them)."""
        if message.role != "device":
            return []
        host = message.device
        if message.state == "online":
            if host not in self.hosts_online:
                self.hosts_online.add(host)
                devices = self.registry.set_host_status(host, "online")
                if devices:
                    log.info("%s online", ", ".join(devices))
            return []
        self.hosts_online.discard(host)
        devices = self.registry.set_host_status(host, "offline")
        self._released.update(devices)
        if devices:
            log.info("%s offline", ", ".join(devices))
        return devices

    def on_reconnect(self) -> None:
        """The server's link came back: forget who was online (the statuses that follow say it again) and, as at a
        restart, let a new agent instance take over any device (its old agent may have died with no last will)."""
        self.hosts_online.clear()
        self._released = {d.device_id for d in self.registry.devices()}
        self.registry.mark_all_offline()

    def refusal(self, message: Register) -> str:
        """Why ``message`` cannot be accepted, or "" when it can."""
        device = message.device
        if self.authenticated and message.host != device:
            return f"a provisioned device registers as itself: host {message.host!r} is not its identity {device!r}; run one feast-agent per bundle"
        if message.preset_digest != self.preset.digest:
            return (
                f"preset mismatch: the device trains preset {message.preset!r}, this federation trains {self.preset.name!r}; "
                f"start feast-agent with --preset {self.preset.name} (or a profile measured for it)"
            )
        if message.task_digest and message.task_digest != self.task.digest:
            return (
                f"task mismatch: the device checked its data against another task than this federation's ({self.task.describe()}, "
                f"digest {self.task.digest[:12]}); start feast-agent with the server's preset file (--preset)"
            )
        if message.samples < 1:
            return "the device has no training examples; check --data"
        limit, source = (
            (self.shard_samples[device], "its shard in the server's partition holds")
            if device in self.shard_samples
            else (self.max_samples, "--max-samples allows")
        )
        if message.samples > limit:
            return f"the device registers {message.samples} training examples; {source} at most {limit} (it is the device's aggregation weight)"
        held = min(self.max_samples, HOLDOUT_RATIO * message.samples)
        if message.holdout > held:
            return (
                f"the device registers {message.holdout} held-out examples beside {message.samples} training examples; "
                f"at most {held} are believable (feast-agent --holdout holds out at most {MAX_HOLDOUT} of each class, "
                f"under {HOLDOUT_RATIO} times what it trains on; --max-samples bounds both)"
            )
        counts = self._count_refusal(message)
        if counts:
            return counts
        if not self.cache.affordable(message.budget_macs):
            return self.cache.below_smallest(
                message.budget_macs, "raise --budget or use a profile of a stronger device"
            )
        existing = self.registry.get(device)
        if existing is None and self.registry.count() >= self.max_devices:
            return f"the federation has its maximum of {self.max_devices} registered devices (--max-devices); raise it, or run another federation"
        taken = existing is not None and existing.instance != message.instance and existing.host in self.hosts_online
        if taken and device not in self._released:
            return f"device id {device!r} is already online (hosted by agent {existing.host!r}); give this agent another --device-id, or stop the other agent first"
        return ""

    def _count_refusal(self, message: Register) -> str:
        """Why the per-class counts of ``message`` are not believable ("" when they are, or when it sent none)."""
        classes = len(self.task.classes)
        for name, counts, total, what in (
            ("class_counts", message.class_counts, message.samples, "training"),
            ("holdout_counts", message.holdout_counts, message.holdout, "held-out"),
        ):
            if not counts:
                continue  # an agent from before per-class counts: coverage leaves it out, and says so
            if len(counts) != classes:
                return f"the device registers {len(counts)} per-class {what} counts; the task has {classes} classes"
            if sum(counts) != total:
                return (
                    f"the device's per-class {what} counts sum to {sum(counts)}, but it registers {total} {what} "
                    "examples; the counts must add up"
                )
        return ""

    def _unanswered(self, device: str, instance: str) -> None:
        """An agent that keeps registering after it was accepted does not receive what this server sends it (one that
        registers new counts, its folder having grown, heard the answers: ``instance`` names the counts too)."""
        seen, count = self._repeats.get(device, (instance, 0))
        count = count + 1 if seen == instance else 1
        self._repeats[device] = (instance, count)
        if count == UNANSWERED:
            log.warning(
                "%s registered but never receives: its agent sent %d registrations and heard no answer on feast/%s/ctrl/%s; a broker bridge or ACL "
                "that does not forward the federation's topics both ways (feast/%s/#) cuts it off (docs/broker.md, bridged brokers)",
                device,
                count,
                self.federation,
                device,
                self.federation,
            )

    def on_register(self, message: Register) -> None:
        device = message.device
        reason = self.refusal(message)
        if not reason:
            self._released.discard(device)
            self._unconfirmed.discard(device)
            status = "online" if message.host in self.hosts_online else "offline"
            before = self.registry.get(device)
            self.registry.register(
                device,
                host=message.host,
                instance=message.instance,
                budget_macs=message.budget_macs,
                samples=message.samples,
                preset=message.preset,
                profile={
                    **message.profile,
                    "holdout": message.holdout,
                    "class_counts": list(message.class_counts),
                    "holdout_counts": list(message.holdout_counts),
                    "evaluate_macs": max(message.evaluate_macs, message.budget_macs),
                    "features": list(message.features),  # the protocol features its agent implements
                },
                status=status,
                precision=message.precision,
            )
            # Agents repeat a registration until it is answered: say it once per agent instance.
            repeat = (
                before is not None
                and before.instance == message.instance
                and (before.budget_macs, before.precision, before.samples)
                == (message.budget_macs, message.precision, message.samples)
            )
            counts = hash((message.samples, message.holdout, message.class_counts, message.holdout_counts))
            self._unanswered(device, f"{message.instance} {counts}")  # bounded: new counts are not a repeat
            log.log(
                logging.DEBUG if repeat else logging.INFO,
                "registered %s (host %s): budget %.2fM MACs (%s), %d samples",
                device,
                message.host,
                message.budget_macs / 1e6,
                message.precision,
                message.samples,
            )
        else:
            log.warning("refused the registration of %s: %s", device, reason)
        self.reply(
            device,
            Registered(
                federation=self.federation,
                round=0,
                device=device,
                instance=message.instance,
                accepted=not reason,
                reason=reason,
                preset=self.preset.name,
                rounds=self.rounds,
                finished=self.finished and not reason,
                task=self.task.to_dict(),
                validation=self.validation,
            ),
        )
