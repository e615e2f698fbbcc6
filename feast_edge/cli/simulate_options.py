"""The settings ``feast-edge simulate`` takes as options beside its population's (feast_edge.cli.population) and
those it reads itself: their help; type, default and ``--help`` panel come from the settings
(feast_edge.sim.config.SimulationConfig, feast_edge.cli.panels)."""

from __future__ import annotations

from feast_edge.cli import common
from feast_edge.cli.panels import help_of
from feast_edge.cli.privacy import DP_HELP
from feast_edge.cli.server_opt import server_opt_help

HELP = {
    "per_round": "Clients sampled per round m.",
    "rounds": "Federation rounds (also the cosine-decay horizon).",
    "variants": "FEAST's variants per batch: full, min, max, min+max or min+max+kd (the paper's ablations).",
    "lr": "Initial SGD learning rate (default: the preset's recipe).",
    "lr_schedule": "cosine or constant over the rounds (default: the preset's recipe).",
    "batch_size": "Local batch size (default: the preset's recipe).",
    "epochs": "Local epochs per round (default: the preset's recipe).",
    "augment": "Augmentation policy: randaugment+mix (method §7), crop-flip+mix, crop-flip, randaugment or none (default: the preset's recipe).",
    "eval_every": "Validate every k rounds.",
    "serve_average": "The last round's second candidate: the mean of the last K rounds' weights, validated beside the round's own weights on the same held-out examples, the better offered to the served-round rule (1: the rounds' own weights; default: min(5, ⌈rounds/4⌉) with --validate-on devices, 1 on the server's split, the paper's selection).",
    "test_limit": "Test on only the first N test examples.",
    "aggregation": "mean (method §6), clip (norm clipping), trimmed-mean or median over the clients covering each position.",
    "trim": "trimmed-mean: share of the covering values dropped at each end, in [0, 0.5).",
    "clip_norm": "clip: L2 bound of an update (default: the cohort's median update norm).",
    "max_weight_ratio": "Treat the shard sizes as self-reported and cap each at this many times the round's median (what feast-server run does to devices' own counts; 0: the paper's weights).",
    "payload_dtype": help_of(common.PayloadDtypeOpt),
    "validate_on": "server: validate on the server's held split (the best round is served); devices: each cohort client tests the model on its own held-out split, as devices do for a server without data, and the served round is the newest without a regression on their served variants (needs --holdout).",
    **server_opt_help(),
    **DP_HELP,
    "secure_agg": "Secure aggregation per routed segment: the server unmasks each segment's sum over at least --colluders + 2 clients, never one client's update; a segment with fewer keeps its global value (docs/security.md §10).",
    "colluders": "--secure-agg: c, the clients besides the server that may collude; a segment's sum is revealed only over at least c + 2 clients.",
    "secagg_bound": "--secure-agg: each client's weighted change per value is clipped to +-this before 32-bit fixed-point encoding.",
    "secagg_neighbours": "--secure-agg: k, how many others each device masks with in each segment and seals its shares for (SecAgg+'s neighbour graph; 0: every other device up to 16 per round, 2*ceil(log2 n) beyond).",
    "mode": 'sync: the paper\'s rounds, each waiting for its cohort; async: buffered asynchronous rounds, released every --buffer updates, never waiting for the slowest client (docs/simulation.md, "Asynchronous rounds").',
    "buffer": "async: updates per release (K); --rounds counts releases.",
    "concurrency": "async: clients training at once (M); a freed slot is refilled by a seeded uniform draw from the idle clients.",
    "max_staleness": "async: an update trained from a model more than this many releases old is refused and counted.",
    "staleness": "async: the discount of a stale update's weight: sqrt (1/sqrt(1+tau)), hinge (none up to 2, then 1/(tau-1)) or constant.",
    "clock": "tiers: each job's virtual time from its reported training MACs over a throughput proportional to the client's budget, plus its payloads over --link-mbps; uniform: every job takes 1 s.",
    "clock_rate": "Training MAC/s of the strongest client on the virtual clock.",
    "link_mbps": "Every client's link on the virtual clock, Mbit/s both ways.",
    "stragglers": "Share of the clients (seeded) that are --straggler-factor times slower.",
    "straggler_factor": "How many times slower a straggler is.",
    "jitter": "Sigma of each job's log-normal slowdown on the virtual clock (0: none).",
    "dropout": "Probability that a job is lost (the device slept or lost its link), after its whole time.",
    "compute_budget": "End the run once its released updates' training MACs reach this, e.g. 5e13 (0: --rounds only); compares synchronous and asynchronous rounds at equal client compute.",
    "round_timeout": "sync: virtual seconds a round waits; later updates are dropped as a server's deadline drops them (0: wait for the slowest).",
}
FLAGS = {"epochs": ("--local-epochs",)}
