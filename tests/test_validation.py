"""[validation]: the same held-out sequences every round, no effect on training, a missing source stops
before step 1; and the metrics sinks (W&B offline). The same loss on any layout and on resume: in
test_evals.py, whose runs on 1 process, FSDP and TP validate too."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import SMALL, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ARGS = ("--config", "configs/debug_model.toml", "--metrics.log_freq", "1", "--training.steps", "5",
        "--validation.freq", "2", *SMALL)


def steps_and_rounds(dump):
    records = [json.loads(ln) for ln in open(os.path.join(dump, "metrics.jsonl"))]
    return [r for r in records if "loss" in r], [r for r in records if "validation_loss" in r]


def train(dump, *args, env=None, expect=0):
    proc = run_training([*ARGS, "--job.dump_folder", dump, *args], env=env)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, *(steps_and_rounds(dump) if expect == 0 else ([], []))


# One thread, as torchrun gives each rank: MKL picks its thread count by load otherwise, and a run on
# a busy machine can then differ from another in the last bit of a loss.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}


# A run with rounds, then the same run without them, in one process (main() closes its process group, loader
# and logs): a process for each would spend ~4.5 s more importing torch. Each run's stdout goes to stdout.txt.
WITH_AND_WITHOUT = r"""
import contextlib
import os
import sys

import train

for dump, enable in ((sys.argv[1], "true"), (sys.argv[2], "false")):
    os.makedirs(dump)
    with open(os.path.join(dump, "stdout.txt"), "w") as out, contextlib.redirect_stdout(out):
        args = [*sys.argv[3:], "--job.dump_folder", dump, "--validation.enable", enable]
        train.main(train.load_config(args))
"""


@pytest.mark.slow
def test_validation_rounds_are_reported_and_leave_training_untouched(tmp_path):
    dump = tmp_path / "with"
    cmd = [sys.executable, "-c", WITH_AND_WITHOUT, str(dump), str(tmp_path / "without"), *ARGS,
           "--metrics.enable_tensorboard"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ONE_THREAD})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps, rounds = steps_and_rounds(dump)
    stdout = (dump / "stdout.txt").read_text()
    assert [r["step"] for r in rounds] == [2, 4, 5]  # every freq steps, and at the last step
    for r in rounds:
        assert set(r) == {"step", "validation_loss", "validation_source_loss", "validation_tokens", "validation_seconds"}
        assert r["validation_tokens"] == 4 * 8 * 64  # 4 sources x 1 batch of 8 x 64 tokens
        assert list(r["validation_source_loss"]) == ["c4", "zyda2_dclm", "zyda2_fwe3", "finemath"]
    assert rounds[1]["validation_loss"] < rounds[0]["validation_loss"]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("validate: step 4  loss ")]
    assert len(lines) == 1 and " ppl " in lines[0], stdout
    assert "(c4 " in lines[0] and ", finemath " in lines[0], stdout
    with open(os.path.join(ROOT, "README.md")) as f:  # its example: the same line
        readme = next(ln.strip() for ln in f if ln.startswith("validate: step "))
    assert re.sub(r"\d[\d,.]*", "0", readme) == re.sub(r"\d[\d,.]*", "0", lines[0]), (readme, lines[0])
    assert lines[0].split("  ")[-2] == "2,048 tokens", lines[0]
    # the README's run is the debug config's own shape: 4 sources x the same 8 windows, of 256 tokens
    assert readme.split("  ")[-2] == "8,192 tokens", readme
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(dump / "tb"))
    tb.Reload()
    for tag, key in (("validation_loss", None), ("validation_source_loss/c4", "c4")):
        assert [e.step for e in tb.Scalars(tag)] == [2, 4, 5]
        want = [r["validation_source_loss"][key] if key else r["validation_loss"] for r in rounds]
        assert [e.value for e in tb.Scalars(tag)] == pytest.approx(want, rel=1e-6)  # TensorBoard keeps float32
    without, none = steps_and_rounds(tmp_path / "without")
    assert none == [] and [r["loss"] for r in without] == [r["loss"] for r in steps]  # bitwise


@pytest.mark.slow
def test_a_missing_validation_source_stops_before_training(tmp_path):
    toml = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    (tmp_path / "c.toml").write_text(toml.replace("validation/fwe3/*.parquet", "validation/no-such-file/*.parquet"))
    proc = run_training(["--config", tmp_path / "c.toml", "--job.dump_folder", tmp_path / "d"], timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and len(proc.stderr.splitlines()) == 1
    assert "'zyda2_fwe3'" in proc.stderr and "step: " not in proc.stdout


def wandb_records(path):
    """The protobuf records of an offline .wandb file: a 7-byte header, then LevelDB-style 32 KiB blocks of
    chunks, each (crc32, length, type) + payload; types 1 (full) and 4 (last) end a record."""
    import struct
    data, pos, buf = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            yield buf
            buf = b""


def wandb_history(dump) -> tuple:
    """(history rows, (project, name, run id) of each run) of a dump folder's offline W&B runs, oldest first."""
    from wandb.proto import wandb_internal_pb2
    rows, names = [], []
    for run in sorted(glob.glob(os.path.join(dump, "wandb", "offline-run-*"))):
        for data in wandb_records(glob.glob(os.path.join(run, "*.wandb"))[0]):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif rec.WhichOneof("record_type") == "run":
                names.append((rec.run.project, rec.run.display_name, rec.run.run_id))
    return rows, names


@pytest.mark.slow
def test_wandb_offline_gets_the_same_scalars_and_a_resume_continues_the_run(tmp_path):
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "test-project", "WANDB_SILENT": "true"}
    train(tmp_path, "--metrics.enable_wandb", "--checkpoint.enable", "--checkpoint.interval", 2,
          "--training.steps", 2, env=env)
    run_id = (tmp_path / "wandb_run_id").read_text()
    train(tmp_path, "--metrics.enable_wandb", "--checkpoint.enable", "--training.steps", 4, env=env)
    assert (tmp_path / "wandb_run_id").read_text() == run_id
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)
    rows, names = wandb_history(tmp_path)
    logged = {}
    for row in rows:  # the training step is a field, W&B's x-axis
        logged.setdefault(row["train_step"], {}).update(row)
    assert sorted(logged) == [1, 2, 3, 4]
    assert set(names) == {("test-project", tmp_path.name, run_id)}  # from WANDB_PROJECT and the dump folder's name
    records = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")]
    step4 = [r for r in records if r["step"] == 4]
    assert logged[4]["loss"] == step4[0]["loss"] and logged[4]["validation_loss"] == step4[1]["validation_loss"]
    assert logged[4]["validation_source_loss/finemath"] == step4[1]["validation_source_loss"]["finemath"]
