"""[validation]: the same held-out sequences every round, the same loss on any layout, no effect on training;
and the metrics sinks (W&B offline)."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(dump, *args, nproc=1, env=None, expect=0):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    cmd = [*launcher, "train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
           "--metrics.log_freq", "1", "--training.steps", "5", "--validation.freq", "2", *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(ln) for ln in open(os.path.join(dump, "metrics.jsonl"))] if expect == 0 else []
    return proc, [r for r in records if "loss" in r], [r for r in records if "validation_loss" in r]


# One thread, as torchrun gives each rank: MKL picks its thread count by load otherwise, and a run on
# a busy machine can then differ from another in the last bit of a loss.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    dump = tmp_path_factory.mktemp("val1")
    return (*train(dump, "--metrics.enable_tensorboard", env=ONE_THREAD), dump)


@pytest.mark.slow
def test_validation_rounds_are_reported_and_leave_training_untouched(one_process, tmp_path):
    proc, steps, rounds, dump = one_process
    assert [r["step"] for r in rounds] == [2, 4, 5]  # every freq steps, and at the last step
    for r in rounds:
        assert set(r) == {"step", "validation_loss", "validation_source_loss", "validation_tokens", "validation_seconds"}
        assert r["validation_tokens"] == 4 * 8 * 256  # 4 sources x 1 batch of 8 x 256 tokens
        assert list(r["validation_source_loss"]) == ["c4", "zyda2_dclm", "zyda2_fwe3", "finemath"]
    assert rounds[1]["validation_loss"] < rounds[0]["validation_loss"]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("validate: step 4  loss ")]
    assert len(lines) == 1 and " ppl " in lines[0] and "(c4 " in lines[0] and ", finemath " in lines[0], proc.stdout
    with open(os.path.join(ROOT, "README.md")) as f:  # its example: the same line, the same held-out tokens
        readme = next(ln.strip() for ln in f if ln.startswith("validate: step "))
    assert re.sub(r"\d[\d,.]*", "0", readme) == re.sub(r"\d[\d,.]*", "0", lines[0]), (readme, lines[0])
    assert readme.split("  ")[-2] == lines[0].split("  ")[-2] == "8,192 tokens", (readme, lines[0])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(dump / "tb"))
    tb.Reload()
    for tag, key in (("validation_loss", None), ("validation_source_loss/c4", "c4")):
        assert [e.step for e in tb.Scalars(tag)] == [2, 4, 5]
        want = [r["validation_source_loss"][key] if key else r["validation_loss"] for r in rounds]
        assert [e.value for e in tb.Scalars(tag)] == pytest.approx(want, rel=1e-6)  # TensorBoard keeps float32
    _, without, none = train(tmp_path, "--validation.enable", "false", env=ONE_THREAD)
    assert none == [] and [r["loss"] for r in without] == [r["loss"] for r in steps]  # bitwise


@pytest.mark.slow
def test_validation_loss_is_the_same_on_fsdp_hsdp_and_tp_and_on_resume(one_process, tmp_path):
    rounds = one_process[2]
    _, _, fsdp = train(tmp_path / "fsdp", "--training.local_batch_size", 4, "--validation.local_batch_size", 2,
                       "--checkpoint.enable", "--checkpoint.interval", 2, nproc=2)
    _, _, hsdp = train(tmp_path / "hsdp", "--training.local_batch_size", 4, "--validation.local_batch_size", 4,
                       "--parallelism.data_parallel_replicate_degree", 2, nproc=2)
    _, _, tp = train(tmp_path / "tp", "--parallelism.tensor_parallel_degree", 2, "--activation_checkpoint.mode",
                     "selective", nproc=2)
    for other in (fsdp, hsdp, tp):
        assert [r["validation_loss"] for r in other] == pytest.approx([r["validation_loss"] for r in rounds], rel=1e-5)
        assert [r["validation_tokens"] for r in other] == [r["validation_tokens"] for r in rounds]
    # Resuming from step 2 replays steps 3-5 and the step-4 and step-5 rounds exactly.
    _, steps, again = train(tmp_path / "fsdp", "--training.local_batch_size", 4, "--validation.local_batch_size", 2,
                            "--checkpoint.enable", "--checkpoint.load_step", 2, nproc=2)
    assert [r["validation_loss"] for r in again[-2:]] == [r["validation_loss"] for r in fsdp[-2:]]
    assert steps[-1]["step"] == 5 and steps[-1]["loss"] == steps[-4]["loss"]  # step 5: first run, then the replay


@pytest.mark.slow
def test_a_missing_validation_source_stops_before_training(tmp_path):
    toml = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    (tmp_path / "c.toml").write_text(toml.replace("validation/fwe3/*.parquet", "validation/no-such-file/*.parquet"))
    proc = subprocess.run([sys.executable, "train.py", "--config", str(tmp_path / "c.toml"), "--job.dump_folder",
                           str(tmp_path / "d")], cwd=ROOT, capture_output=True, text=True, timeout=300)
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
    from wandb.proto import wandb_internal_pb2
    logged, names = {}, []
    for run in runs:
        for data in wandb_records(glob.glob(os.path.join(run, "*.wandb"))[0]):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                logged.setdefault(items["_step"], {}).update(items)
            elif rec.WhichOneof("record_type") == "run":
                names.append((rec.run.project, rec.run.display_name, rec.run.run_id))
    assert sorted(logged) == [1, 2, 3, 4]
    assert set(names) == {("test-project", tmp_path.name, run_id)}  # from WANDB_PROJECT and the dump folder's name
    records = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")]
    step4 = [r for r in records if r["step"] == 4]
    assert logged[4]["loss"] == step4[0]["loss"] and logged[4]["validation_loss"] == step4[1]["validation_loss"]
    assert logged[4]["validation_source_loss/finemath"] == step4[1]["validation_source_loss"]["finemath"]
