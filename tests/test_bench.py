"""bench.py runs end to end on CPU (its numbers go to the README; here only that it works and reports)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args):
    proc = subprocess.run([sys.executable, "bench.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_matrix_runs_every_combination_and_reports_failures():
    out = bench("matrix", "--config", "configs/debug_model.toml", "--model.n_layers", "2", "--steps", "4",
                "--warmup", "2", "--vary", "activation_checkpoint.mode=none,full",
                "--vary", "training.local_batch_size=4,3")  # 3 is not a multiple of the 2 data streams
    rows = [ln for ln in out.splitlines() if ln.startswith("| none") or ln.startswith("| full")]
    assert len(rows) == 4, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[1] == "3":  # a bad combination is a row that says why, and the next one still runs
            assert "failed: error: data.num_streams = 2 must be a multiple" in cells[2] and cells[-1] == "-"
        else:
            assert re.fullmatch(r"[\d,]+", cells[2]) and cells[4] == "n/a" and float(cells[5]) > 0, row
    est = {tuple(c.strip() for c in r.strip("|").split("|")[:2]): r.strip("|").split("|")[-1] for r in rows}
    assert float(est[("full", "4")]) < float(est[("none", "4")])  # bench.py's estimate, per run


def test_memory_prints_the_estimate_for_a_big_flavor_with_fewer_layers():
    full = bench("memory", "--config", "configs/llama3_8b.toml", "--world_size", "8")
    short = bench("memory", "--config", "configs/llama3_8b.toml", "--world_size", "1", "--model.n_layers", "8")
    gib = [float(re.search(r"estimate per device: ([\d.]+) GiB", o).group(1)) for o in (full, short)]
    assert 20 < gib[0] < 80 and gib[1] > gib[0]  # one GPU holds all states of the 8-layer model


def test_overhead_and_startup_run():
    out = bench("overhead", "--config", "configs/debug_model.toml", "--training.seq_len", "64", "--steps", "4",
                "--warmup", "2", "--repeats", "1")
    assert re.search(r"overhead: trainer [\d,]+ / bare [\d,]+ tokens/s = [\d.]+", out)
    out = bench("startup", "--config", "configs/debug_model.toml", "--repeats", "1")
    assert re.search(r"[\d.]+s beyond importing torch", out)


def test_matrix_under_torchrun_and_bad_arguments():
    out = bench("matrix", "--nproc", "2", "--config", "configs/debug_model.toml", "--model.n_layers", "2",
                "--steps", "4", "--warmup", "2", "--vary", "parallelism.tensor_parallel_degree=1,2")
    rows = [ln for ln in out.splitlines() if re.match(r"\| [12] \|", ln)]
    assert len(rows) == 2 and all(re.match(r"\| [12] \| [\d,]+ \|", r) for r in rows), out
    for args, message in [(["matrix", "--vary", "training.steps"], "--vary training.steps: expected section.key="),
                          (["matrix"], "--vary (none given)"),
                          (["memory", "--config", "nope.toml"], "config file 'nope.toml' not found"),
                          (["overhead", "--warmup", "0"], "--warmup 0: must be >= 1"),
                          (["matrix", "--vary", "training.steps=5,10"], "training.steps is set by bench.py"),
                          (["overhead", "--config", "configs/debug_model.toml", "--training.stpes", "3"],
                           "unknown key in [training] 'stpes'")]:
        proc = subprocess.run([sys.executable, "bench.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
