"""One PNG of one or more runs' curves, read from their metrics.jsonl: training loss (raw and smoothed,
skipped steps marked), validation loss (overall and per source), eval accuracy per task, lr and grad
norm, tokens/s and MFU, data wait and memory; each phase's first step ([[phases]]) marked on every
panel. Several runs are overlaid, a colour each.

    python plot.py outputs/llama3_8b                               # -> outputs/llama3_8b/curves.png
    python plot.py outputs/run_a outputs/run_b --out ab.png --x tokens

It reads a live run too (a last line still being written is left for next time). A run resumed from
an earlier checkpoint logged some steps twice: the last record of a step wins, so it reads as one curve.
"""

import argparse
import io
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display on a login node or in a Slurm job
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

PANELS = ("training loss", "validation loss", "eval accuracy", "lr and grad norm", "tokens/s and MFU",
          "data wait and memory")
POINTS_PER_SPAN = 25  # the smoothed loss: an exponential moving average over 1/25 of the logged steps


class PlotError(Exception):
    """A folder that is not a run, or a run with nothing to plot yet: one line."""


def record_kind(r: dict) -> str:
    """Which curve a metrics.jsonl record belongs to; "" for other records (the job's goodput line)."""
    for key, kind in (("loss", "train"), ("validation_loss", "validation"), ("eval_acc", "eval"),
                      ("skipped", "skipped")):
        if key in r and "step" in r:
            return kind
    return ""


def read_run(folder: str) -> dict:
    """{kind: {step: record}} of a run's dump folder, the last record of a step winning."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        what = "no such folder" if not os.path.isdir(folder) else "no metrics.jsonl in it"
        raise PlotError(f"{folder}: {what}: give a run's dump folder (job.dump_folder)")
    with open(path) as f:
        lines = f.read().splitlines()
    run = {"train": {}, "validation": {}, "eval": {}, "skipped": {}}
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # a live run is writing it
                continue
            raise PlotError(f"{path}:{n}: not a JSON record")
        kind = record_kind(r)
        if kind:
            run[kind][r["step"]] = r
    if not run["train"]:
        raise PlotError(f"{path}: no training step logged yet")
    return run


def smoothed(values: list) -> list:
    """An exponential moving average whose span grows with the run: raw for a short run."""
    keep = 1 - 2 / (max(1.0, len(values) / POINTS_PER_SPAN) + 1)  # the weight of the average so far
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = keep * avg + (1 - keep) * v
        out.append(avg / (1 - keep**i))  # debiased: the first points are not pulled to 0
    return out


def series(records: dict, key, x_of) -> tuple:
    """(x, y) of the records that have `key` (a function of the record, or a key) as a number."""
    get = key if callable(key) else (lambda r: r.get(key))
    points = [(x_of(step), get(r)) for step, r in sorted(records.items())]
    points = [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    return [x for x, _ in points], [y for _, y in points]


def tokens_at(train: dict):
    """step -> tokens seen after it, exact at a logged step and between two within one phase (the
    tokens a step are a phase's): linear between the logged steps, which include each phase's first."""
    steps = sorted(train)
    known = [(0, 0)] + [(s, train[s]["tokens_seen"]) for s in steps if "tokens_seen" in train[s]]

    def at(step):
        i = next((i for i, (s, _) in enumerate(known) if s >= step), len(known) - 1)
        (s0, t0), (s1, t1) = known[max(i - 1, 0)], known[i]
        return t1 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return at


def phase_starts(train: dict) -> dict:
    """{step: phase} of each phase's first step after phase 0 (the trainer logs it whatever log_freq)."""
    starts, last = {}, 0
    for step, r in sorted(train.items()):
        if r.get("phase", 0) != last:
            starts[step] = last = r["phase"]
    return starts


def plot(runs: dict, x: str = "step"):
    """The figure of runs ({name: read_run(folder)}), against steps or tokens seen."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), layout="constrained")
    axes = dict(zip(PANELS, axes.flat))
    twins = {name: axes[name].twinx() for name in PANELS[3:]}
    marks = []  # (x, colour, phase) of each phase's first step, drawn on every panel with a curve
    for i, (name, run) in enumerate(runs.items()):
        color = f"C{i}"
        train = run["train"]
        x_of = tokens_at(train) if x == "tokens" else (lambda step: step)
        xs, loss = series(train, "loss", x_of)
        ax = axes["training loss"]
        ax.plot(xs, loss, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(xs, smoothed(loss), color=color, label=name)
        for step in run["skipped"]:
            ax.axvline(x_of(step), color=color, linestyle=":", alpha=0.6)
        marks += [(x_of(step), color, phase) for step, phase in phase_starts(train).items()]
        ax = axes["validation loss"]
        ax.plot(*series(run["validation"], "validation_loss", x_of), "o-", color=color, label=name)
        sources = {s for r in run["validation"].values() for s in r["validation_source_loss"]}
        for k, source in enumerate(sorted(sources)):
            xy = series(run["validation"], lambda r: r["validation_source_loss"].get(source), x_of)
            style = ("--", ":", "-.", (0, (5, 1)))[k % 4]  # a source's style is the same in every run
            label = source if len(runs) == 1 else None  # several runs: the legend names the runs
            ax.plot(*xy, linestyle=style, color=color, alpha=0.6, linewidth=0.9, label=label)
        tasks = {t for r in run["eval"].values() for t in r["eval_acc"]}
        for j, task in enumerate(sorted(tasks)):
            xy = series(run["eval"], lambda r: r["eval_acc"].get(task), x_of)
            axes["eval accuracy"].plot(*xy, "o-", color=color, alpha=1 - 0.15 * j, label=f"{name}: {task}")
        for panel, left, right in (("lr and grad norm", "lr", "grad_norm"), ("tokens/s and MFU", "tps", "mfu"),
                                   ("data wait and memory", "data_wait_pct", "memory_gib")):
            axes[panel].plot(*series(train, left, x_of), color=color, label=f"{name}: {left}")
            twins[panel].plot(*series(train, right, x_of), "--", color=color, label=f"{name}: {right}")
    labels = {"lr and grad norm": ("lr", "grad norm (dashed)"), "tokens/s and MFU": ("tokens/s per device",
              "MFU % (dashed)"), "data wait and memory": ("data wait % of the step", "memory GiB (dashed)")}
    for panel, ax in axes.items():
        ax.set_title(panel)
        ax.set_xlabel("tokens seen" if x == "tokens" else "step")
        if x == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter())  # 200k, 1.5G
        if panel in labels:
            ax.set_ylabel(labels[panel][0])
            twins[panel].set_ylabel(labels[panel][1])
        if ax.lines:
            ax.legend(fontsize="small")
            for at, color, phase in marks:
                ax.axvline(at, color=color, linestyle="--", alpha=0.4, linewidth=0.8)
                if panel == "training loss":
                    ax.annotate(f"phase {phase}", (at, 1), xycoords=("data", "axes fraction"), rotation=90,
                                va="top", ha="right", fontsize="small", color=color)
        else:
            ax.text(0.5, 0.5, f"no {panel} logged", ha="center", va="center", transform=ax.transAxes)
    return fig


def save_png(fig, out: str):
    """The curves need few colours: a 64-colour palette keeps the PNG small to copy off a cluster."""
    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=80)
    Image.open(rendered).convert("RGB").quantize(colors=64).save(out, optimize=True)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's dump folder (job.dump_folder)")
    p.add_argument("--out", help="the PNG to write (default: RUN_DIR/curves.png of the first run)")
    p.add_argument("--x", choices=("step", "tokens"), default="step", help="the x axis")
    args = p.parse_args(argv)
    try:
        runs = {os.path.normpath(folder): read_run(folder) for folder in args.runs}
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.runs[0], "curves.png")
    save_png(plot(runs, args.x), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
