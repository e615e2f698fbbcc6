"""A designed preset as a commented TOML file: every value with the reason it was chosen (docs/presets.md)."""

from __future__ import annotations

import json
import textwrap

from feast_edge.cache.design import (
    FINAL_RESOLUTION,
    HEADROOM,
    REACH,
    SMALL_DATA_BATCH,
    SMALL_DATA_IMAGES,
    PresetDesign,
    macs_text,
)
from feast_edge.cache.search import MAX_INITIAL_DRAWS
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout

WIDTH = 116
DEFAULT_STATS = (
    "0.5 / 0.25 are placeholders: measure your images' statistics (or write the preset with --classes-from DIR, "
    "which does) and set them BEFORE building the cache: mean and std enter the preset digest, so changing them "
    "later makes the cache stale."
)


def _comment(*paragraphs: str) -> list[str]:
    return [
        line
        for text in paragraphs
        for line in textwrap.wrap(text, WIDTH - 2, initial_indent="# ", subsequent_indent="# ")
    ]


def _num(value: float) -> str:
    """A MAC count as a TOML integer with digit groups (``25_000_000``)."""
    return f"{round(value):_}"


def _list(values: tuple) -> str:
    return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in values) + "]"


def preset_toml(d: PresetDesign) -> str:
    """The preset of ``d`` as TOML with comments (``load_preset_file`` reads it back to ``d.preset``)."""
    p = d.preset
    res = " -> ".join(str(row[4]) for row in arch_layout(p, Arch.largest(p)).summary_rows())
    shape = f"{p.in_channels}x{p.input_size}x{p.input_size}"
    lines = [
        *_comment(
            f"Written by 'feast-edge preset new' for {shape} images, {p.classes} classes, devices of "
            f"{macs_text(d.low)} to {macs_text(d.high)} MACs; docs/presets.md explains every field. The full supernet "
            f"is {macs_text(d.largest_macs)} MACs / {d.largest_params / 1e6:.3g}M params "
            f"({d.largest_macs / d.high:.1f}x the top budget, like fmnist-small's 99.7M over its 40M top variant); "
            f"its smallest architecture is {macs_text(d.smallest_macs)} MACs.",
            "Edit freely. The cache ('feast-edge cache build') is tied to [input] channels, size, classes, mean and "
            "std, [stem] and [stages] (the preset digest): change any of them and rebuild it. class_names, resize, "
            "[cache] and [population] are not in the digest.",
        ),
        f"name = {json.dumps(p.name, ensure_ascii=False)}",
        f"description = {json.dumps(p.description, ensure_ascii=False)}",
        "",
        "[input]",
        f"channels = {p.in_channels}",
        f"size = {p.input_size}",
        f"classes = {p.classes}",
        *_comment(f"Per-channel normalization of pixels in [0, 1]. {d.stats_note or DEFAULT_STATS}"),
        f"mean = {_list(p.mean)}",
        f"std = {_list(p.std)}",
        *_comment(
            "The task contract (feast_edge/data/task.py): the class names in the order of the model's outputs, each "
            "also the folder name of its images (<root>/<class>/); resize: how an image of another size becomes "
            f"{p.input_size}x{p.input_size}: stretch, center-crop (keeps the aspect ratio) or pad (keeps the whole "
            "image)."
        ),
        f"class_names = {_list(p.class_names)}",
        f"resize = {json.dumps(p.resize)}",
        "",
        *_comment(
            f"Proportions of {d.shape.preset} (stem {d.shape.stem}, stages {list(d.shape.stages)}, up to "
            f"{d.shape.max_extra_blocks} extra blocks, its expansion ratios) scaled by {d.scale:.2f}, the shipped "
            f"shape that needs the smaller rescaling to put the full supernet near {HEADROOM:g}x the top budget"
            + _reach_text(d)
            + f"Resolutions (stem, then each stage): {res}; "
            + (
                "one stride-2 step more than the shipped presets' rule (last stage at about "
                f"{FINAL_RESOLUTION}x{FINAL_RESOLUTION}): without it no architecture fits the low budget."
                if d.extra_stride
                else f"the last stage runs at about {FINAL_RESOLUTION}x{FINAL_RESOLUTION}, as in the shipped presets."
            )
        ),
        "[stem]",
        f"channels = {p.stem_channels}",
        f"stride = {p.stem_stride}",
        "",
        "[stages]",
        f"channels = {list(p.stage_channels)}",
        f"strides = {list(p.stage_strides)}",
        f"max_extra_blocks = {p.max_extra_blocks}",
        f"expansion_ratios = {list(p.expansion_ratios)}",
        f"width_multipliers = {list(p.width_multipliers)}",
        *_comment(
            "Every variant's channel count is a multiple of 8 (and at least 8)."
            if p.divisor == 8
            else f"Variants' channel counts are multiples of {p.divisor} (at least {p.divisor}): with 8, the "
            "smallest architecture at these strides would not fit the low budget with a feasible cache."
        ),
        f"divisor = {p.divisor}",
        "",
        *_comment(*_cache_text(d)),
        "[cache]",
        "segments = [",
        *(
            f'    {{ name = "{s.name}", start = {_num(s.start)}, stop = {_num(s.stop)}, count = {s.count}, '
            f"rho0 = {s.rho0:.2f} }},"
            for s in p.cache_segments
        ),
        "]",
        *_comment(
            "Ceiling for post-hoc extraction of a budget not in the cache: the step with the largest from_macs <= budget."
        ),
        "extraction = [",
        *(f"    {{ from_macs = {_num(s.from_macs)}, rho0 = {s.rho0:.2f} }}," for s in p.extraction_rho),
        "]",
        "",
        *_comment(
            "Simulated client budgets (method §4, feast-edge simulate): Zipf over [budget_min, budget_max] MACs; data "
            "allocation uses min(b, budget_cap). The floor is the low budget, the cap the top one, the ceiling "
            f"{HEADROOM:g}x the cap (the paper's 1500M over 600M)."
        ),
        "[population]",
        f"budget_min = {_num(p.budget_min)}",
        f"budget_max = {_num(p.budget_max)}",
        f"budget_cap = {_num(p.budget_cap)}",
        "",
        *_comment(*_train_text(d)),
        "[train]",
        *(f"{key} = {json.dumps(value)}" for key, value in p.train),
        "",
    ]
    return "\n".join(lines)


def _train_text(d: PresetDesign) -> list[str]:
    batch = dict(d.preset.train).get("batch_size")
    if d.images is None:
        data = (
            "The number of images was not measured (--classes, not --classes-from), so the batch stays 64; "
            f"with fewer than {SMALL_DATA_IMAGES:,} images set batch_size = {SMALL_DATA_BATCH}: twice the SGD steps "
            "per round at the same compute."
        )
    elif batch is not None:
        data = (
            f"{d.images:,} images in the --classes-from folder (fewer than {SMALL_DATA_IMAGES:,}): batch {batch}, so that a "
            "device's few images still give it enough SGD steps per round (twice those of batch 64, same compute)."
        )
    else:
        data = (
            f"{d.images:,} images in the --classes-from folder ({SMALL_DATA_IMAGES:,} or more): batch 64, as method §7."
        )
    why = (
        "Training recipe (method §7 for every key not given here; keys: feast_edge/space/preset.py RECIPE_KEYS). Not "
        "the paper's RandAugment + Mixup/CutMix at lr 0.025: that regularises long runs on 50,000+ images, and on a "
        "few thousand it keeps the model from learning within tens of rounds (docs/presets.md: 54 % against 96 % "
        "test accuracy on handwritten digits after 20 rounds). No augmentation and lr 0.05 are fmnist-small's "
        "measured recipe; a flip would also be wrong for digits and text."
    )
    return [why, data, "[train] is not in the preset digest: edit it freely, no cache rebuild."]


def _reach_text(d: PresetDesign) -> str:
    if d.short_scale is None:
        return ". "
    return (
        f" ({d.short_scale:.2f}), raised: there the cache's search for the top target stops at a "
        f"{macs_text(d.short_macs)} network ({d.short_macs / d.high:.0%} of {macs_text(d.high)}), as wider networks "
        f"lose more in the fitness's 1000 x rho term than they gain in entropy; here it finds {macs_text(d.top_macs)} "
        f"(at least {REACH:.0%} is required). "
    )


def _cache_text(d: PresetDesign) -> list[str]:
    segs = d.preset.cache_segments
    text = ["Targets of the fixed variant cache (method §3): one GA search per target, merged and sorted by MACs."]
    if len(segs) == 1:
        s = segs[0]
        text.append(
            f"The range is narrow (under 4x), so one segment of {s.count} targets under rho0 = {s.rho0:.2f}, the "
            "smallest ceiling of 0.31, 0.36, ... at which every target is feasible."
        )
    else:
        main, low = segs
        text.append(
            f"A main segment from {macs_text(main.start)} to {macs_text(main.stop)} ({main.count} targets, "
            f"{macs_text((main.stop - main.start) / (main.count - 1))} apart) under the paper's rho0 = {main.rho0:.2f}, "
            f"and a low-compute segment from {macs_text(low.start)} to {macs_text(low.stop)} ({low.count} targets, "
            f"{macs_text((low.stop - low.start) / (low.count - 1))} apart: the weakest devices are the most numerous) "
            f"under rho0 = {low.rho0:.2f}, the smallest ceiling of 0.40, 0.45, ... at which every target of the "
            f"segment is feasible. Small networks have a high rho (the smallest architecture here: "
            f"{d.smallest_rho:.3f}), so the main ceiling would leave the bottom of the range infeasible "
            "(see fmnist-small.toml)."
        )
    text.append(
        f"Feasibility: the GA fills its first population within about {max(d.draws.values()):,.0f} uniform draws at "
        f"the worst target (it gives up after {MAX_INITIAL_DRAWS:,}); the top target's search finds a "
        f"{macs_text(d.top_macs)} network ({d.top_macs / d.high:.0%} of it). These settings do not enter the preset "
        "digest."
    )
    return text
