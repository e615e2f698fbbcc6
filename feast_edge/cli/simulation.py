"""``feast-edge simulate``: the paper's research protocol in one process (or ``--nproc`` processes), with its progress display."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from feast_edge.cli.common import (
    DashboardOpt,
    DashboardTokenOpt,
    DeterministicOpt,
    DeviceOpt,
    TensorBoardOpt,
    check_dashboard,
    make_console,
    millions,
)
from feast_edge.cli.panels import by_concern, settings_options
from feast_edge.cli.population import POPULATION_KEYS, population_options
from feast_edge.cli.progress import Stage
from feast_edge.cli.server_opt import betas
from feast_edge.errors import FeastError
from feast_edge.sim.config import SimulationConfig
from feast_edge.space.arch import Arch

console = make_console()
# simulate's options whose names differ from their settings' keys (feast_edge.sim.config.SimulationConfig)
RENAMED = {"local_epochs": "epochs", "data": "data_dir", "method_option": "method_options", "profiles": "budgets"}
PERSONALIZING = "personalizing every client (--personalize)"


def _say(text: str) -> None:
    console.print(text, soft_wrap=True, highlight=False)


@by_concern(SimulationConfig, renamed=RENAMED, rest="Process and output")
@population_options
@settings_options(
    SimulationConfig,
    "simulation",
    exclude=POPULATION_KEYS,
    flags={"epochs": ("--local-epochs",)},
    cli_types={"server_betas": str},
    parse={"server_betas": betas},
)
def simulate(
    population: dict[str, Any],
    settings: dict[str, Any],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory: checkpoints and results.")],
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="feast, centralized (reference), heterofl, scalefl, fiarse, sfn or dfn (docs/baselines.md).",
        ),
    ] = "feast",
    method_option: Annotated[
        Optional[list[str]],
        typer.Option(
            "--method-option", help="KEY=VALUE option of the method (repeatable; e.g. tiers=1,0.5,0.25 for heterofl)."
        ),
    ] = None,
    recipe: Annotated[
        Optional[list[str]],
        typer.Option(
            "--recipe",
            help="KEY=VALUE override of any [train] recipe key (repeatable; e.g. mixup_alpha=0.2, randaugment=[2,9]).",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    amp: Annotated[
        str,
        typer.Option(
            "--amp",
            help="Mixed precision of local training: off (float32, the default), auto, bf16 or fp16 (feast only).",
        ),
    ] = "off",
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")
    ] = False,
    match_compute: Annotated[
        Optional[Path],
        typer.Option(
            "--match-compute",
            help="A finished run's directory: train as many rounds as spend its training compute (replaces --rounds; "
            "a baseline matched to FEAST, as the paper's matched-compute experiment).",
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc",
            help="Processes on this machine to spread each round's cohort over (torch.distributed; same weights as 1).",
        ),
    ] = 1,
    threads: Annotated[
        int,
        typer.Option(
            "--threads",
            min=0,
            help="PyTorch intra-op threads per process (0: the cores free at the start, shared out by --nproc; kept for "
            "the whole run and recorded in results.json).",
        ),
    ] = 0,
    deterministic: DeterministicOpt = False,
    dist_backend: Annotated[
        str,
        typer.Option(
            "--dist-backend",
            help="With --nproc or torchrun: auto (NCCL with a GPU per process, else gloo), gloo or nccl.",
        ),
    ] = "auto",
    personalize: Annotated[
        str,
        typer.Option(
            "--personalize",
            help="After the last round, each client's personal model of its served variant, measured on its own "
            "held-out split: auto (the best of prior, head, bn, proximal on a selection split, kept only if it beats "
            "the served model there), off, METHOD or METHOD:STRENGTH (e.g. prior:0.5); FEAST only.",
        ),
    ] = "off",
    holdout: Annotated[
        Optional[float],
        typer.Option(
            "--holdout",
            help="With --personalize or --validate-on devices: each client's share of its shard held out per class "
            "(default 0.1). The held-out examples never train, so the training data (and the weights) differ from a "
            "run without them.",
        ),
    ] = None,
    dashboard: DashboardOpt = None,
    dashboard_token: DashboardTokenOpt = None,
    tensorboard: TensorBoardOpt = False,
) -> None:
    """Run the paper's protocol in one process: population, rounds, evaluation, results."""
    from feast_edge.local.precision import resolve_amp
    from feast_edge.local.torch_device import describe_device, resolve_device
    from feast_edge.sim.setup import DEFAULT_HOLDOUT
    from feast_edge.sim.simulate import Simulation

    requested, device = device, resolve_device(device)
    precision = resolve_amp(amp, device)
    from feast_edge.local.recipe import VARIANT_MODES

    if method in VARIANT_MODES:
        raise FeastError(f"--method {method} is an ablation of FEAST; use --method feast --variants {method}")
    validate_on = settings["validate_on"]
    config = SimulationConfig.of(
        **population,
        **settings,
        method=method,
        method_options=parse_pairs(method_option, "--method-option"),
        recipe=tuple((k, _recipe_value(v)) for k, v in parse_pairs(recipe, "--recipe")),
        device=device,
        amp=precision.mode,
        deterministic=deterministic,
        personalize=personalize.strip(),
        holdout=holdout
        if holdout is not None
        else (0.0 if personalize.strip() == "off" and validate_on != "devices" else DEFAULT_HOLDOUT),
    )
    config.train_config()  # validates the method, its options and the recipe before any data is read
    setup, matched = None, None
    if match_compute is not None:
        from feast_edge.sim.matched import matched_config
        from feast_edge.sim.setup import build_setup

        setup = build_setup(config)
        config, matched = matched_config(config, setup, match_compute)
        _say(
            f"matched compute: {matched.rounds} rounds of {config.method} spend {matched.predicted_train_macs / 1e12:.2f} "
            f"TMAC, {matched.run_method}'s {matched.run_rounds} rounds in {match_compute} spent "
            f"{matched.target_train_macs / 1e12:.2f} TMAC"
        )
    rounds = config.training.rounds
    from feast_edge.cli.worker import COMMAND
    from feast_edge.sim.distributed import Spread

    spread = Spread(
        config, nproc, threads, dist_backend, COMMAND
    )  # one line for a bad --nproc, before any data is read
    if spread.worker:  # under torchrun, ranks > 0 only train their share of each round
        spread.serve()
        return
    check_dashboard(dashboard, dashboard_token)
    _say(
        f"loading {config.dataset} from {config.data_dir}; drawing the budgets and data shards of {config.population.clients} clients"
    )
    threads = {"intra_op": spread.threads, "chosen": spread.chosen}
    if spread.world.size > 1:
        _say(spread.describe())
    sim = Simulation(
        config,
        out,
        setup=setup,
        matched=None if matched is None else matched.to_dict(),
        threads=threads,
        clients=spread.clients if spread.world.size > 1 else None,
    )
    _say(str(sim.setup.population))
    _say(f"{describe_device(device, requested)}, {precision.describe()}")
    if not config.server_optimizer().identity:
        _say(f"server optimizer: {config.server_optimizer().describe()}")
    _say(
        f"{spread.threads} intra-op thread{'s' * (spread.threads != 1)} per process for the whole run: {spread.chosen}"
    )
    done = _completed_rounds(out) if resume else 0
    if done:
        _say(f"resuming after round {done}/{rounds} from {out / 'checkpoint.safetensors'}")
    label = "release" if config.schedule.mode == "async" else "round"  # async: --rounds counts releases
    display = _SimulationDisplay(rounds, done, len(sim.setup.cache.entries), label)
    live, web = _simulation_dashboard(sim, dashboard, dashboard_token, out)
    try:
        results = sim.run(
            resume=resume,
            on_round=display.on_round,
            on_test=display.on_test,
            on_record=live and live.round_finished,
            tensorboard=tensorboard,
            on_personal=display.on_personal,
        )
    except BaseException:
        display.stage.finish(ok=False)
        spread.close(ok=False)
        if web is not None:
            web.stop()
        raise
    display.stage.finish()
    spread.close()
    if live is not None:
        live.finished(results)
        web.stop()
        _say(f"dashboard stopped; browse the finished run with: feast-edge dashboard {out}")
    # The preset by name (config.preset may be a long path): a title wider than the table would wrap.
    preset_name = results.get("preset") or Path(config.preset).stem
    chosen = "best checkpoint" if config.validation.validate_on == "server" else "served round"
    table = Table(
        title=f"{preset_name}, {config.method}: test accuracy per served model "
        f"({chosen}, round {results['best'].get('round', '-')})",
        caption=None if config.validation.validate_on == "server" else results["served_round"]["reason"],
    )
    for col in ("#", "MACs", "params", "accuracy", "model"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for v in results["variants"]:
        model = str(Arch.from_dict(v["arch"])) if "arch" in v else v["label"]
        table.add_row(
            str(v["index"]), millions(v["macs"]), millions(v["params"]), f"{100 * v['test_accuracy']:.2f}%", model
        )
    console.print(table)
    if "personalization" in results:
        console.print(personalization_table(results["personalization"]))
        _say(personalization_line(results["personalization"]))
    if "privacy" in results:
        from feast_edge.privacy.private_rounds import privacy_line

        _say(privacy_line(results["privacy"]))
    comm = results["communication"]
    saving = "nothing sent" if comm["reduction"] is None else f"{comm['reduction']:.2f}x less"
    in_bytes = (
        ""
        if comm["bytes_reduction"] is None
        else (
            f"; {comm['routed_bytes_total'] / 1e6:,.1f} MB as {config.aggregation.payload_dtype} vs {comm['full_bytes_total'] / 1e6:,.1f} MB float32 ({comm['bytes_reduction']:.2f}x less)"
        )
    )
    console.print(
        f"population accuracy (largest affordable variant per client): {100 * results['population_accuracy']:.2f}%\n"
        f"traffic: sent {comm['routed_params_total'] / 1e6:,.1f}M params vs full {comm['full_params_total'] / 1e6:,.1f}M "
        f"({saving}){in_bytes}; training compute {results['compute']['train_macs_total'] / 1e12:,.2f} TMAC\n"
        f"results: {out / 'results.json'}, {out / 'variants.csv'}, {out / 'rounds.csv'}",
        soft_wrap=True,
    )


def personalization_table(block: dict[str, Any]) -> Table:
    """``--personalize``'s summary: own held-out accuracy, mean and worst decile over the clients, served and personal."""
    summary = block["summary"]
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    table = Table()
    for col in (f"own held-out acc. ({summary['choice']})", "mean", "worst decile"):
        table.add_column(col, justify="right" if table.columns else "left")
    for name in ("served", "personal"):
        table.add_row(name, pct(summary[f"{name}_mean"]), pct(summary[f"{name}_worst_decile"]))
    return table


def personalization_line(block: dict[str, Any]) -> str:
    """Under :func:`personalization_table`: ``feast_edge.personalize.fleet.summary_lines``, as markup-safe text."""
    from rich.markup import escape

    from feast_edge.personalize.fleet import summary_lines

    return "\n".join(escape(line) for line in summary_lines(block))


def _simulation_dashboard(sim: Any, bind: str | None, token: str | None, out: Path) -> tuple[Any, Any]:
    """``--dashboard``: the simulation's live view and its web server (both None without the option)."""
    if bind is None:
        return None, None
    from feast_edge.cli.common import open_dashboard
    from feast_edge.cli.live import SimulationLive
    from feast_edge.dashboard.state import DashboardState

    live = SimulationLive(DashboardState("simulation", f"feast-edge simulate: {out.name}"), sim)
    live.attach()
    return live, open_dashboard(live.state, bind, token, _say)


def parse_pairs(items: list[str] | None, option: str) -> tuple[tuple[str, str], ...]:
    """``["k=v", ...]`` -> ``(("k", "v"), ...)``; a one-line error for an item without ``=`` or a repeated key."""
    pairs: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FeastError(f"{option} {item!r} is not KEY=VALUE; write e.g. {option} tiers=1,0.5")
        if key.strip() in pairs:
            raise FeastError(f"{option} {key.strip()} is given twice; give each key once")
        pairs[key.strip()] = value.strip()
    return tuple(pairs.items())


def _recipe_value(text: str) -> Any:
    """A --recipe value: a JSON number, list or boolean, else the text itself (e.g. a policy name)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return tuple(value) if isinstance(value, list) else value


def _completed_rounds(out: Path) -> int:
    """Rounds the checkpoint in ``out`` holds (0 without one; --resume then says what is missing)."""
    from feast_edge.run.checkpoint import read_record

    path = out / "checkpoint.safetensors"
    return int(read_record(path, format=None).get("fields", {}).get("round", 0)) if path.is_file() else 0


class _SimulationDisplay:
    """``simulate``'s progress: the rounds, then the final test of every cached variant, each a labelled :class:`Stage`."""

    def __init__(self, rounds: int, done: int, variants: int, label: str = "round") -> None:
        self.variants = variants
        self.stage = Stage(console, label, rounds, done=done).start()
        self.testing = False

    def on_round(self, p: Any) -> None:
        pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
        chosen = f"best {pct(p.best_val)}" if p.served_round is None else f"served round {p.served_round}"
        clock = "" if p.clock is None else f"  clock {p.clock:.0f} s"
        stale = "" if p.staleness is None else f"  staleness <= {p.staleness}"
        withheld = f"  {p.withheld} segment{'s' * (p.withheld != 1)} withheld" if p.withheld else ""
        grown = "" if p.present is None else f"  {p.present} clients, {p.visible} examples"
        self.stage.update(
            p.round, f"loss {p.loss:.3f}  val {pct(p.val_accuracy)}  {chosen}{clock}{stale}{withheld}{grown}", line=True
        )
        if p.round == p.rounds:
            self._start_testing()  # say so at once: the first variant takes a while

    def on_test(self, done: int, total: int) -> None:
        self._start_testing()
        self.stage.update(done)

    def on_personal(self, done: int, total: int) -> None:
        if self.stage.label != PERSONALIZING:
            self.stage.finish()
            self.stage = Stage(console, PERSONALIZING, total).start()
        self.stage.update(done)

    def _start_testing(self) -> None:
        if not self.testing:
            self.testing = True
            self.stage.finish()
            self.stage = Stage(
                console, f"testing {self.variants} cached variants (BN recalibration + test set)", self.variants
            ).start()
