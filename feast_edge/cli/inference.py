"""``feast-agent predict`` and ``feast-agent evaluate``: run a device's ONNX model on image files.

Both read the task (input size, channels, resize policy, class names) from the
model file's metadata; tables go to stdout, progress to stderr, and with
``--json`` stdout holds one JSON document and nothing else. A personal model's
file also names the classes it was tuned to (``feast_edge.personalize.tuned``):
both say which, and ``evaluate`` scores those classes apart from the others.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from feast_edge.cli import common
from feast_edge.cli.progress import Stage

ModelOpt = Annotated[
    Path, typer.Option("--model", "-m", help="The ONNX file (from feast-agent fetch-model or --model-dir).")
]
BatchOpt = Annotated[int, typer.Option("--batch-size", min=1, help="Images per onnxruntime run.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout (for scripts), nothing else.")]
SHOWN_SKIPS = 3  # skipped files named on the console; the rest are counted


def _stage(label: str, total: int, batch_size: int) -> Any:
    """A progress bar on stderr when the work takes more than one batch."""
    return Stage(common.make_console(stderr=True), label, total) if total > batch_size else nullcontext(None)


def _personal(loaded: Any) -> tuple[bool, Any]:
    """Whether ``loaded`` is a personal model (``DEVICE.personal.onnx``) and the classes it was tuned to (None: its
    file is from before it recorded them, or it is no personal model); FeastError if its metadata does not add up."""
    from feast_edge.errors import FeastError
    from feast_edge.personalize.tuned import Tuned, TunedError

    try:
        tuned = Tuned.read_metadata(loaded.meta, loaded.task.classes)
    except TunedError as exc:
        raise FeastError(f"model {loaded.path}: {exc}; write the personal model again (feast-agent run)") from None
    return "personal_method" in loaded.meta or tuned is not None, tuned


def _say_skipped(skipped: tuple[Any, ...]) -> None:
    """One line on stderr naming the first few unreadable files and counting the rest."""
    if not skipped:
        return
    named = "; ".join(f"{s.file} ({s.reason})" for s in skipped[:SHOWN_SKIPS])
    more = f"; and {len(skipped) - SHOWN_SKIPS} more" if len(skipped) > SHOWN_SKIPS else ""
    common.make_console(stderr=True).print(
        f"skipped {len(skipped)} file(s): {escape(named)}{more}", soft_wrap=True, highlight=False
    )


def predict(
    target: Annotated[Path, typer.Argument(help="An image file, or a folder of images (searched recursively).")],
    model: ModelOpt,
    k: Annotated[int, typer.Option("--top-k", "-k", help="Classes shown per image, most probable first.")] = 3,
    as_json: JsonOpt = False,
    batch_size: BatchOpt = 64,
    threads: int = 0,  # --threads: feast-agent registers these commands with its one threads option (threaded)
) -> None:
    """Classify image files with the ONNX model: the top-k class names and probabilities per file."""
    from feast_edge.evaluate.predict import check_top_k, collect_files, load_model
    from feast_edge.evaluate.predict import predict as run_predict

    loaded = load_model(model, threads=threads or None)
    check_top_k(k, loaded.task)
    files, is_folder = collect_files(target)
    with _stage(f"predicting {len(files)} images", len(files), batch_size) as stage:
        update = None if stage is None else (lambda done, total: stage.update(done))
        result = run_predict(loaded, files, k, batch_size, skip_unreadable=is_folder, progress=update)
    _say_skipped(result.skipped)
    if as_json:
        typer.echo(result.to_json())
        return
    console = common.make_console()
    console.print(f"{model}: {escape(loaded.task.describe())}", soft_wrap=True, highlight=False)
    tuned = _personal(loaded)[1]
    if tuned is not None and tuned.partial:
        console.print(f"personal model {escape(tuned.words())}", soft_wrap=True, highlight=False)
    table = Table()
    table.add_column("file", overflow="fold")
    for rank in range(1, k + 1):
        table.add_column(f"#{rank}" if k > 1 else "class", no_wrap=True)
    base = target if is_folder else None
    for item in result.items:
        shown = str(Path(item.file).relative_to(base)) if base is not None else item.file
        table.add_row(escape(shown), *(f"{escape(name)} {100 * p:.1f}%" for name, _, p in item.top))
    console.print(table)


def evaluate(
    model: ModelOpt,
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="Labelled data: an image folder <folder>/<class name>/<files>, a manifest CSV (path,label), CIFAR binary or Fashion-MNIST IDX.",
        ),
    ],
    split: Annotated[
        str | None,
        typer.Option(
            "--split",
            help="The split to score, train, val or test, where the data holds splits (a Fashion-MNIST or CIFAR "
            "folder, an image folder laid out as train/, test/); default: its test split. Data without splits is "
            "scored whole.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
    batch_size: BatchOpt = 64,
    threads: int = 0,  # --threads: feast-agent registers these commands with its one threads option (threaded)
) -> None:
    """Accuracy of the ONNX model on labelled images (by default a data set's test split): overall and per class."""
    from feast_edge.cli.progress import lazy_stage
    from feast_edge.data.sources import load_data
    from feast_edge.evaluate.predict import evaluate as run_evaluate
    from feast_edge.evaluate.predict import load_model

    loaded = load_model(model, threads=threads or None)
    personal, tuned = _personal(loaded)
    chosen = _split_to_score(data, loaded.task, split)
    # The agent's own loader (decoded once, cached), with the model's task: labels by class name.
    with lazy_stage(common.make_console(stderr=True), "reading images") as update:
        labelled = load_data(data, loaded.task, split=chosen or "train", progress=update)
    skipped = sum(labelled.skipped.values())
    if skipped:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(labelled.skipped.items()))
        common.make_console(stderr=True).print(f"skipped {skipped} file(s): {reasons}", soft_wrap=True, highlight=False)
    with _stage("evaluating", len(labelled.labels), batch_size) as stage:
        update = None if stage is None else (lambda done, total: stage.update(done))
        scores = run_evaluate(loaded, labelled.images, labelled.labels, batch_size, skipped=skipped, progress=update)
    report = scores.to_dict()
    if personal:
        report["personal"] = _personal_report(tuned, scores, loaded.task.classes)
        if tuned is not None:
            for row in report["classes"]:
                row["tuned"] = row["class"] in tuned.classes
    if as_json:
        typer.echo(json.dumps({"model": str(model), "data": str(data), "split": chosen, **report}, indent=2))
        return
    console = common.make_console()
    console.print(
        f"{model} on {escape(labelled.source)}: {escape(loaded.task.describe())}", soft_wrap=True, highlight=False
    )
    table = Table()
    columns = ("class", "index", "examples", "correct", "accuracy", *(["tuned to"] if tuned is not None else []))
    for col in columns:
        table.add_column(col, justify="right" if col in ("index", "examples", "correct", "accuracy") else "left")
    for c in scores.classes:
        mark = [] if tuned is None else ["yes" if c.name in tuned.classes else "no: serve the global model"]
        row = (escape(c.name), str(c.index), f"{c.examples:,}", f"{c.correct:,}", f"{100 * c.accuracy:.2f}%", *mark)
        table.add_row(*row)
    table.add_section()
    table.add_row("all", "", f"{scores.examples:,}", f"{scores.correct:,}", f"{100 * scores.accuracy:.2f}%")
    console.print(table)
    scored = f"the {chosen} split" if chosen else f"all of {data}, which has no train/test split"
    console.print(
        f"accuracy {100 * scores.accuracy:.2f}% on {escape(scored)} ({scores.correct:,} of {scores.examples:,} images, "
        f"{len(scores.classes)} of the model's {len(loaded.task.classes)} classes), {scores.skipped} file(s) skipped",
        soft_wrap=True,
        highlight=False,
    )
    if personal:
        console.print(escape(_personal_line(report["personal"])), soft_wrap=True, highlight=False)


def _split_to_score(data: Path, task: Any, asked: str | None) -> str | None:
    """The split ``evaluate`` scores: ``asked``, else the test split (then val, then train) of data that holds splits;
    None for data without splits (scored whole). FeastError where ``asked`` is not a split ``data`` holds."""
    from feast_edge.data.releases import RELEASES
    from feast_edge.data.scan import SPLITS
    from feast_edge.data.sources import detect_kind, splits_of
    from feast_edge.errors import FeastError

    if asked is not None and asked not in SPLITS:
        raise FeastError(f"--split {asked!r} is not a split; use one of {', '.join(SPLITS)}")
    held = splits_of(data, task)
    if asked is None:
        chosen = next((s for s in ("test", "val", "train") if s in held), None)
        if chosen not in (None, "test"):
            common.make_console(stderr=True).print(
                f"{escape(str(data))} holds no test split: scoring its {chosen} split", soft_wrap=True, highlight=False
            )
        return chosen
    if asked not in held:
        kind = RELEASES.get(detect_kind(data), detect_kind(data))
        if not held:
            raise FeastError(
                f"--split {asked}: {kind} {data} has no splits (it is scored whole); leave out --split, or pass a "
                f"folder laid out as {data}/{asked}/<class name>/<file>"
            )
        raise FeastError(
            f"--split {asked}: {kind} {data} holds no {asked} split (it holds {' and '.join(held)}); "
            f"pass --split {held[-1]}, or a folder that holds the {asked} split"
        )
    return asked


def _personal_report(tuned: Any, scores: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """What ``evaluate --json`` says of a personal model: the classes it was tuned to and not, and the accuracy over
    each part of the images evaluated (None where the file is from before it recorded its classes)."""
    from feast_edge.personalize.tuned import split_accuracy

    if tuned is None:
        return {"personal_classes": None, "personal_task_classes": None, "not_tuned_to": None, "tuned": ""}
    split = split_accuracy(tuned, ((c.name, c.examples, c.correct) for c in scores.classes))
    return {
        **tuned.to_dict(),
        "not_tuned_to": tuned.untuned(names),
        "tuned": tuned.words(),
        "on_tuned_classes": split["tuned"],
        "on_other_classes": split["not_tuned"],
    }


def _personal_line(part: dict[str, Any]) -> str:
    """``personal model tuned to 6 of 10 classes: …; serve the global model for the others: 98.00% on those (…),
    0.00% on the other classes (…)``, or what is known where less is."""
    if part["personal_classes"] is None:
        return "personal model: its file does not record the classes it was tuned to (written before it did)"
    if not part["tuned"]:
        return f"personal model tuned to all {part['personal_task_classes']} classes"

    def share(s: dict[str, Any]) -> str:
        if not s["examples"]:
            return "no images"
        return f"{100 * s['accuracy']:.2f}% ({s['correct']:,} of {s['examples']:,} images)"

    return (
        f"personal model {part['tuned']}: {share(part['on_tuned_classes'])} on those, "
        f"{share(part['on_other_classes'])} on the other {len(part['not_tuned_to'])}"
    )
