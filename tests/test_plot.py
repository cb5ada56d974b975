"""plot.py: the panels of two runs' curves, read as a resumed and a live run leave metrics.jsonl, and one line
for a folder that is not a run. The Figure is inspected, not its pixels."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import plot  # noqa: E402

SOURCES = ("c4", "finemath")


def write_run(folder, steps, resumed_at=None, tail=""):
    """metrics.jsonl as train.py writes it: a training record per step (512 tokens a step), validation every 5
    steps, an eval at 10; resumed_at: a second launch from that step, which logs those steps again with other
    losses; tail: a line still being written."""
    folder.mkdir()
    records = []
    launches = [range(1, steps + 1)] if resumed_at is None else [range(1, steps + 1), range(resumed_at + 1, steps + 1)]
    for launch, steps_of_it in enumerate(launches):
        for step in steps_of_it:
            records.append({"step": step, "loss": 8.0 - 0.1 * step + launch, "grad_norm": 1.0, "lr": 1e-3,
                            "memory_gib": 0.5, "tps": 1000.0, "mfu": None, "data_wait_pct": 0.1,
                            "tokens_seen": 512 * step, "time": 0.0})
            if step % 5 == 0:
                records.append({"step": step, "validation_loss": 7.0 - 0.1 * step,
                                "validation_source_loss": {s: 7.0 for s in SOURCES}, "validation_tokens": 64})
            if step == 10:
                records.append({"step": step, "eval_acc": {"piqa": 0.5, "arc_easy": 0.25},
                                "eval_acc_norm": {"piqa": 0.5, "arc_easy": 0.25}, "eval_seconds": 1.0})
    records.append({"step": 3, "skipped": "loss spike"})
    records.append({"step": steps, "goodput": 0.9})  # slurm/recover.py's line: not a curve
    text = "".join(json.dumps(r) + "\n" for r in records)
    (folder / "metrics.jsonl").write_text(text + tail)
    return str(folder)


def test_two_runs_draw_every_panel_and_a_resumed_run_reads_as_one_curve(tmp_path):
    a = write_run(tmp_path / "a", 12, resumed_at=6)
    b = write_run(tmp_path / "b", 10, tail='{"step": 11, "lo')  # live: its last line half written
    runs = {name: plot.read_run(folder) for name, folder in (("a", a), ("b", b))}
    assert sorted(runs["a"]["train"]) == list(range(1, 13))
    assert runs["a"]["train"][7]["loss"] == 8.0 - 0.7 + 1  # the second launch's record of step 7 wins
    fig = plot.plot(runs)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert tuple(axes) == plot.PANELS
    loss = axes["training loss"]
    raw_a, smooth_a, skip_a, raw_b, smooth_b, skip_b = loss.lines  # each run: raw, smoothed, its skipped step
    assert list(raw_a.get_xdata()) == list(range(1, 13)) and list(raw_b.get_xdata()) == list(range(1, 11))
    assert list(skip_a.get_xdata()) == [3, 3]  # a vertical line at the skipped step
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a", "b"]
    validation = axes["validation loss"]
    assert len(validation.lines) == 2 * (1 + len(SOURCES))  # overall and per source, for each run
    assert list(validation.lines[0].get_xdata()) == [5, 10]
    assert len(axes["eval accuracy"].lines) == 2 * 2  # two tasks, two runs
    twins = {panel: next(ax for ax in fig.axes if ax is not axes[panel] and ax.bbox.bounds == axes[panel].bbox.bounds)
             for panel in plot.PANELS[3:]}
    for panel, twin in twins.items():  # one quantity on the left axis, one on its twin, for each run
        assert len(axes[panel].lines) == 2 and len(twin.lines) == 2, panel
    assert len(twins["tokens/s and MFU"].lines[0].get_ydata()) == 0  # MFU is n/a on a CPU: no points
    tokens = plot.plot(runs, x="tokens")
    assert list(tokens.axes[0].lines[0].get_xdata())[:2] == [512, 1024]


def test_the_program_writes_a_png_and_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    run = write_run(tmp_path / "run", 10)
    assert plot.main([run]) == 0
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "metrics.jsonl").write_text("")
    for folder, why in (("missing", "no such folder"), ("empty", "no metrics.jsonl in it"),
                        ("started", "no training step logged yet")):
        assert plot.main([run, str(tmp_path / folder), "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and why in err, err
    assert not (tmp_path / "x.png").exists()
