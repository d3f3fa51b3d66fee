"""How a report comparison is shown: text, Markdown (a pull-request comment), JSON, a plot."""

from __future__ import annotations

import json
import math
from typing import Any

from pytest_gradref.report.diff import DRIFT_SIGMAS, Diff, ItemDiff, Missing

FORMATS = ("text", "markdown", "json")


class PlotUnavailable(Exception):
    """--plot was asked for where matplotlib is not installed."""


def _num(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.3g}"


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3g}x"


# Marks a ratio taken after the noise floor raised one error or both (see _floored).
FLOORED_MARK = "*"
FLOORED_LEGEND = (
    "the noise floor raised one error or both before the ratio was taken: it is not after / before"
)


def _floored(item: ItemDiff) -> bool:
    """Whether the item's ratio is not after / before because its noise floor (``noise_floor``,
    at least --floor) raised one error or both. An unchanged error is left unmarked: its ratio
    of 1 reads true either way."""
    before, after, floor = (
        (item.norm_before, item.norm_after, item.norm_noise_floor)
        if item.normwise
        else (item.before, item.after, item.noise_floor)
    )
    if math.isnan(item.ratio) or before == after:
        return False
    return min(before, after) < floor


def _share(value: float) -> str:
    return "n/a" if math.isnan(value) or math.isinf(value) else f"{value:.1%}"


def _headroom(item: ItemDiff) -> str:
    """Headroom before -> after: the share of the allowance left (100% exact, 0% at the limit,
    negative when failing). Both values, not their difference: a passing item whose headroom
    shrank a little must not read as a failure."""
    return f"{_share(item.headroom_before)} -> {_share(item.headroom_after)}"


def _mark(item: ItemDiff) -> str:
    if item.regression:
        return item.regression
    if item.uncounted:
        return f"{item.uncounted} (not counted: see the note)"
    return ""


def _shown(diff: Diff, top: int) -> list[ItemDiff]:
    """Every regression, then the worst others up to ``top`` rows in all (0: every item)."""
    if top <= 0:
        return diff.items
    return diff.items[: max(top, len(diff.regressions))]


def noise_phrase(noise: float) -> str:
    """How the verdict line states the noise rule."""
    steps = "a rounding step" if noise == 1 else f"{noise:g} rounding steps"
    return (
        f"errors within {steps} of their dtype at their scale count as noise; a half-precision "
        f"item's normwise error drifts when it grows past {DRIFT_SIGMAS:g} sigmas of its "
        "rounding noise"
    )


def _verdict_line(diff: Diff) -> str:
    count = len(diff.regressions)
    noun = "regression" if count == 1 else "regressions"
    return (
        f"{count} {noun} in {len(diff.items)} compared items "
        f"(threshold {diff.threshold:g}x; {noise_phrase(diff.noise)})"
    )


def render_text(diff: Diff, top: int = 20) -> str:
    lines = [
        f"base: {diff.base.path}: {diff.base.describe()}",
        f"new:  {diff.new.path}: {diff.new.describe()}",
    ]
    lines += [f"compared despite a mismatch: {m}" for m in diff.mismatches]
    if diff.uncounted_why:
        lines.append(f"note: {diff.uncounted_why}")
    lines.append(_verdict_line(diff))
    shown = _shown(diff, top)
    if shown:
        headroom = "headroom before -> after"
        header = f"{'ratio':>9}  {'before':>9}  {'after':>9}  {headroom:>24}  {'dtype':>8}  item"
        lines.append(header)
    for item in shown:
        mark = f"  <- {_mark(item)}" if _mark(item) else ""
        floored = FLOORED_MARK if _floored(item) else " "
        lines.append(
            f"{_ratio(item.ratio):>9}{floored} {_num(item.before):>9}  {_num(item.after):>9}  "
            f"{_headroom(item):>24}  {item.dtype:>8}  "
            f"{item.nodeid}: {item.label}{mark}"
        )
    if any(_floored(item) for item in shown):
        lines.append(f"{FLOORED_MARK} {FLOORED_LEGEND}")
    if len(shown) < len(diff.items):
        lines.append(f"... {len(diff.items) - len(shown)} more items (--top 0 shows all)")
    for title, entries in (
        ("only in base (coverage that vanished)", diff.only_in_base),
        ("only in new", diff.only_in_new),
    ):
        if entries:
            lines.append(f"{title}: {len(entries)}")
            lines += [f"  {entry.describe()}" for entry in entries]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(diff: Diff, top: int = 20) -> str:
    status = "**precision regression**" if diff.regressions else "no precision regression"
    lines = [
        f"### gradref diff: {status}",
        "",
        f"{_verdict_line(diff)}.",
        "",
        f"- base `{diff.base.path}`: {diff.base.describe()}",
        f"- new `{diff.new.path}`: {diff.new.describe()}",
    ]
    lines += [f"- compared despite a mismatch: {m}" for m in diff.mismatches]
    if diff.uncounted_why:
        lines.append(f"- note: {diff.uncounted_why}")
    shown = _shown(diff, top)
    if shown:
        lines += [
            "",
            "| | ratio | before | after | headroom before -> after | dtype | test | item |",
            "|---|---:|---:|---:|---:|---|---|---|",
        ]
    for item in shown:
        mark = f":x: {item.regression}" if item.regression else _mark(item)
        floored = f"\\{FLOORED_MARK}" if _floored(item) else ""
        lines.append(
            f"| {mark} | {_ratio(item.ratio)}{floored} | {_num(item.before)} | "
            f"{_num(item.after)} | {_headroom(item)} | {item.dtype} | `{_cell(item.nodeid)}` | "
            f"{_cell(item.label)} |"
        )
    if any(_floored(item) for item in shown):
        lines += ["", f"\\{FLOORED_MARK} {FLOORED_LEGEND}."]
    if len(shown) < len(diff.items):
        lines += ["", f"{len(diff.items) - len(shown)} more items not shown."]
    for title, entries in (
        ("Only in base (coverage that vanished)", diff.only_in_base),
        ("Only in new", diff.only_in_new),
    ):
        if entries:
            lines += ["", f"{title}: {len(entries)}", ""]
            lines += [f"- `{_cell(entry.describe())}`" for entry in entries]
    return "\n".join(lines) + "\n"


def _json_number(value: float) -> Any:
    return value if math.isfinite(value) else str(value)


def render_json(diff: Diff) -> str:
    def setup(report: Any) -> dict[str, Any]:
        return {
            "path": report.path,
            "format_version": report.format_version,
            "base_seed": report.base_seed,
            "torch": report.torch,
            "device": report.device,
            "backend": report.backend,
            "strategy": report.strategy,
            "strategy_is_default": report.strategy_is_default,
            "default_strategy": report.default_strategy,
            "simulated": report.simulated,
        }

    def missing(entries: list[Missing]) -> dict[str, Any]:
        return {
            "tests": [e.nodeid for e in entries if e.label is None],
            "items": [{"nodeid": e.nodeid, "label": e.label} for e in entries if e.label],
        }

    document = {
        "base": setup(diff.base),
        "new": setup(diff.new),
        "threshold": diff.threshold,
        "floor": diff.floor,
        "noise": diff.noise,
        "mismatches": diff.mismatches,
        "uncounted_why": diff.uncounted_why or None,
        "regressions": len(diff.regressions),
        "items": [
            {
                "nodeid": item.nodeid,
                "label": item.label,
                "dtype": item.dtype,
                "before": _json_number(item.before),
                "after": _json_number(item.after),
                "ratio": _json_number(item.ratio),
                "noise_floor": _json_number(item.noise_floor),
                # The normwise errors ("nan" where a report has none) and whether the ratio is
                # theirs: a ratio that before / after do not give is told apart.
                "norm_before": _json_number(item.norm_before),
                "norm_after": _json_number(item.norm_after),
                "normwise": item.normwise,
                "norm_noise_floor": _json_number(item.norm_noise_floor),
                # A half-precision item's drift band, "nan" where not judged (see diff.py).
                "drift_band": _json_number(item.drift_band),
                "numel": item.numel,
                "headroom_before": _json_number(item.headroom_before),
                "headroom_after": _json_number(item.headroom_after),
                "passed_before": item.passed_before,
                "passed_after": item.passed_after,
                "regression": item.regression or None,
                "uncounted": item.uncounted or None,
                # What kind of change it is (nan, now_fails, grew, drifted), counted or not.
                "kind": item.kind.name.lower() if item.kind is not None else None,
            }
            for item in diff.items
        ],
        "only_in_base": missing(diff.only_in_base),
        "only_in_new": missing(diff.only_in_new),
    }
    return json.dumps(document, indent=2) + "\n"


def render(diff: Diff, fmt: str, top: int = 20) -> str:
    if fmt == "markdown":
        return render_markdown(diff, top)
    if fmt == "json":
        return render_json(diff)
    return render_text(diff, top)


def check_plotting() -> None:
    """Raise PlotUnavailable, with the fix, where matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which cannot be imported ({error}); install it with "
            "pip install 'pytest-gradref[plot]' (or pip install matplotlib)"
        ) from None


def plot(diff: Diff, path: str) -> None:
    """Each item's error before against after, log axes, the diagonal and the threshold line;
    errors below the floor are drawn at the floor, regressions in red."""
    check_plotting()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [i for i in diff.items if not (math.isnan(i.before) or math.isnan(i.after))]
    figure = Figure(figsize=(6, 6))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for regression, colour, name in ((False, "tab:blue", "items"), (True, "tab:red", "regression")):
        chosen = [i for i in points if bool(i.regression) == regression]
        if chosen:
            axes.scatter(
                [max(i.before, diff.floor) for i in chosen],
                [max(i.after, diff.floor) for i in chosen],
                s=14,
                color=colour,
                label=f"{name} ({len(chosen)})",
            )
    values = [max(v, diff.floor) for i in points for v in (i.before, i.after)] or [diff.floor]
    low, high = min(values) / 2, max(values) * 2 * diff.threshold
    axes.plot([low, high], [low, high], color="grey", linewidth=0.8, label="unchanged")
    axes.plot(
        [low, high / diff.threshold],
        [low * diff.threshold, high],
        color="tab:red",
        linestyle="--",
        linewidth=0.8,
        label=f"threshold {diff.threshold:g}x",
    )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(low, high)
    axes.set_ylim(low, high)
    axes.set_xlabel(f"error in base ({diff.base.path})")
    axes.set_ylabel(f"error in new ({diff.new.path})")
    axes.set_title(f"gradref diff: {len(diff.regressions)} of {len(diff.items)} items regressed")
    axes.legend(loc="upper left")
    figure.savefig(path, dpi=100)
