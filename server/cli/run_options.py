"""The settings ``feast-server run`` takes as options (feast_edge.server.config.ServerConfig, by key): their help,
names and bounds; type, default and ``--help`` panel come from the settings themselves (feast_edge.cli.panels)."""

from __future__ import annotations

from feast_edge.cli import common
from feast_edge.cli.panels import help_of
from feast_edge.cli.privacy import DP_HELP
from feast_edge.cli.server_opt import server_opt_help
from feast_edge.server.cli.shared import PrecisionOpt, ServingRuleOpt

_OWN = {
    "preset": "Preset name or .toml file.",
    "seed": "Seed of the model init, cohorts and client seeds.",
    "data": "Server-held validation/calibration data: a partition directory (feast-edge partition), a Fashion-MNIST or CIFAR directory (its test split), or an image folder or manifest CSV (labelled by the preset's class names). Without it the server holds no data: the devices validate on their held-out splits and calibrate their own models.",
    "cache": "Variant cache JSON (default: the one beside the preset's file, else the shipped one).",
    "per_round": "Devices sampled per round M.",
    "min_clients": "K: devices needed online to start a round, and valid updates needed to change the model.",
    "start_clients": "Devices to wait for before the first round (default: --min-clients).",
    "max_samples": "Refuse a device that registers more training examples than this (its aggregation weight); a partition's own counts apply to its clients.",
    "max_devices": "Refuse registrations beyond this many devices (bounds the registry).",
    "rounds": "Federation rounds R (also the cosine-decay horizon).",
    "lr": "Initial SGD learning rate, decayed over --rounds (default: the preset's [train] recipe).",
    "batch_size": "Local batch size (default: the preset's [train] recipe).",
    "epochs": "Local epochs per round (default: the preset's [train] recipe).",
    "variants": "FEAST's variants per batch: full, min, max, min+max or min+max+kd (the paper's ablations).",
    "aggregation": "mean (method §6), or a robust rule: clip, trimmed-mean, median (docs/security.md §5).",
    "trim": "trimmed-mean: share of the values covering a position dropped at each end.",
    "clip_norm": "clip: L2 bound of each update's change (default: the round's median).",
    "max_weight_ratio": "A device's self-reported sample count weighs at most this many times the round's median count; counts of a partition given as --data are never capped (0: no cap; docs/security.md §5).",
    "max_update_norm": "Reject an update that changes its routed slice by more than this L2 norm (0: no bound).",
    "eval_every": "Validate the model every k rounds and after the last, keeping the best round's: on --data, or without it on the held-out examples of the round's devices (feast-agent run --holdout).",
    "val_samples": "Validation examples taken from --data (server-held data).",
    "serve_average": "The last round's second candidate: the mean of the last K rounds' weights, validated beside the round's own weights on the same held-out examples, the better offered to the served-round rule (1: the rounds' own weights; default: min(5, ⌈rounds/4⌉) without --data, where the devices validate, 1 on --data).",
    "calib_samples": "BN-calibration examples: taken from --data, or, without it, what each device recalibrates on.",
    "bn_calibration": "Without --data, where each served variant's BN statistics come from: federated (every device that can run it reports per-channel moments of its data, the server combines them) or device (each device recalibrates on its own data only).",
    "bn_rule": "How the devices' BN statistics are combined: screened (refuse reports far from the median of all, mix the rest; a lone pair that disagrees is not used), median (per-channel weighted median) or mixture (every report as sent: one lying device steers it). docs/security.md §9.",
    "val_rule": "How the devices' held-out accuracies are combined: median (each device one vote; chooses the served round only with 3 or more devices) or pooled (all counts summed, each capped by --max-weight-ratio).",
    "round_timeout": "Seconds a round waits for updates (stragglers never block).",
    "mode": 'sync: rounds, each waiting for its cohort up to --round-timeout; async: buffered asynchronous rounds, released every --buffer updates, never waiting for the slowest device (docs/protocol.md, "Asynchronous rounds").',
    "buffer": "async: updates per release (K); --rounds counts releases.",
    "concurrency": "async: devices training at once (M); a device that finishes frees its slot, refilled at once by a seeded uniform draw from the idle online devices.",
    "max_staleness": "async: an update trained from a model more than this many releases old is refused and counted.",
    "staleness": "async: the discount of a stale update's weight: sqrt (1/sqrt(1+tau)), hinge (none up to 2, then 1/(tau-1)) or constant (central DP needs constant).",
    "secure_agg": "Secure aggregation per routed segment: the devices mask their updates and the server unmasks only each segment's sum over at least --colluders + 2 devices, never one device's update; a segment with fewer keeps its global value (docs/security.md §10, docs/protocol.md §8).",
    "colluders": "--secure-agg: c, the devices besides the server that may collude; a segment's sum is revealed only over at least c + 2 devices.",
    "secagg_bound": "--secure-agg: each device's weighted change per value is clipped to +-this before 32-bit fixed-point encoding (what one device can add to a sum the server cannot check).",
    "secagg_timeout": "--secure-agg: seconds each key stage (keys, sealed shares, unmasking) waits for the devices still in the round; a device that misses one is out of the round.",
    "secagg_neighbours": "--secure-agg: k, how many others each device masks with in each segment and seals its shares for (SecAgg+'s neighbour graph; 0: every other device up to 16 per round, 2*ceil(log2 n) beyond).",
    "wait_timeout": "Idle limit: end the run (last round checkpointed) when a round waited this long for enough devices (0: wait forever).",
}
HELP = {
    **_OWN,
    "payload_dtype": help_of(common.PayloadDtypeOpt),
    **server_opt_help(),
    **DP_HELP,
    "serving_rule": help_of(ServingRuleOpt),
    "precision": help_of(PrecisionOpt),
    "int8_samples": help_of(common.Int8SamplesOpt),
    "int8_tolerance": help_of(common.Int8ToleranceOpt),
    "chunk_size": help_of(common.ChunkOpt),
}
FLAGS = {"preset": ("--preset", "-p"), "epochs": ("--local-epochs",)}
BOUNDS = {
    "rounds": {"min": 1},
    "per_round": {"min": 1},
    "min_clients": {"min": 1},
    "start_clients": {"min": 1},
    "round_timeout": {"min": 0.1},
    "batch_size": {"min": 1},
    "epochs": {"min": 1},
    "eval_every": {"min": 1},
    "val_samples": {"min": 1},
    "serve_average": {"min": 1},
    "calib_samples": {"min": 1},
    "wait_timeout": {"min": 0.0},
    "max_update_norm": {"min": 0.0},
    "max_samples": {"min": 1},
    "max_devices": {"min": 1},
    "buffer": {"min": 1},
    "concurrency": {"min": 1},
    "max_staleness": {"min": 0},
    "int8_samples": {"min": 1},
    "chunk_size": {"min": 1024, "max": 16 * 1024 * 1024},
}
