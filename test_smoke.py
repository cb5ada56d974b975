"""End-to-end smoke tests: the debug config trains on CPU with 1 and 2 processes (FSDP2, TP=2,
HSDP).

    python -m pytest test_smoke.py -q
"""

import json
import os
import re

import pytest

from conftest import SMALL, run_training

ROOT = os.path.dirname(os.path.abspath(__file__))
LOG_LINE = re.compile(r"^step: +(\d+)  loss: +[\d.]+  grad_norm: +[\d.]+  lr: [\d.]+e[-+]\d+  "
                      r"memory: [\d.]+GiB\([\d.]+%\)  tps: [\d,]+  tflops: [\d.]+  "
                      r"mfu: (n/a|[\d.]+%)  data_wait: [\d.]+%  elapsed \d+m\d\ds  eta \d+m\d\ds$", re.M)


def train(dump, *args, nproc=1):
    """train.py's output, on nproc ranks (forked as under torchrun: conftest.run_training)."""
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
            "--metrics.log_freq", "1", "--validation.enable", "false", *SMALL, *args]
    proc = run_training(argv, nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(dump):
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = map(json.loads, f)
        return {r["step"]: r["loss"] for r in records if "loss" in r}  # not validation rounds


def test_fsdp_two_processes_trains_and_logs(fsdp_reference):
    dump, out = fsdp_reference
    steps = [int(m.group(1)) for m in LOG_LINE.finditer(out)]
    assert steps == list(range(1, 11)), out[-2000:]
    loss = losses(dump)
    assert loss[10] < loss[1] - 1.0  # the debug model learns quickly on the bundled data
    record = json.loads(open(os.path.join(dump, "metrics.jsonl")).readline())
    for key in ("step", "loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu",
                "tokens_seen", "source_tokens", "data_wait_pct"):
        assert key in record
    assert record["tokens_seen"] == 8 * 64
    assert set(record["source_tokens"]) == {"c4", "zyda2_dclm", "zyda2_fwe3", "finemath"}
    assert sum(record["source_tokens"].values()) == 8 * 65  # windows are seq_len + 1 tokens
    assert "flavor = \"debugmodel\"" in open(os.path.join(dump, "config.toml")).read()
    assert sorted(os.listdir(os.path.join(dump, "checkpoint"))) == ["step-10", "step-5"]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert LOG_LINE.search(readme), "README.md's example step line is not what train.py prints"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The dump folder of 10 steps on one process, local batch 8: the FSDP reference's global batch."""
    dump = tmp_path_factory.mktemp("one_process")
    train(dump, "--training.steps", 10, "--training.local_batch_size", 8)
    return dump


@pytest.mark.slow
def test_one_process_matches_two_fsdp_processes(fsdp_reference, one_process):
    one = losses(one_process)        # one process, local batch 8
    two = losses(fsdp_reference[0])  # two FSDP ranks, local batch 4 each
    assert one.keys() == two.keys()
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), (step, one[step], two[step])


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_differs(one_process, tmp_path):
    train(tmp_path / "same", "--training.steps", 10, "--training.local_batch_size", 8)
    train(tmp_path / "other", "--training.steps", 1, "--training.local_batch_size", 8, "--training.seed", 1)
    assert losses(tmp_path / "same") == losses(one_process)
    assert losses(tmp_path / "other")[1] != losses(one_process)[1]


def test_tensor_parallel_two_processes(tp_reference, fsdp_reference):
    dump, out = tp_reference
    assert len(LOG_LINE.findall(out)) == 10
    # Clipping's norm over the FSDP and TP shards is one all-reduce (distributed.init_distributed flattens
    # the mesh), not two in sequence, which DTensor warns about on every rank.
    assert "sequential all_reduce" not in out, out[-3000:]
    tp = losses(dump)
    fsdp = losses(fsdp_reference[0])
    assert tp[10] < tp[1] - 1.0
    # Same init, same data and same global batch as the FSDP run; only the reduction order differs.
    assert abs(tp[1] - fsdp[1]) < 1e-5 and abs(tp[10] - fsdp[10]) < 1e-3


@pytest.mark.slow
def test_hsdp_replicate_two_matches_fsdp(fsdp_reference, tmp_path):
    train(tmp_path, "--training.steps", 10, "--training.local_batch_size", 4,
          "--parallelism.data_parallel_replicate_degree", 2, nproc=2)
    hsdp = losses(tmp_path)
    fsdp = losses(fsdp_reference[0])
    for step in hsdp:
        assert abs(hsdp[step] - fsdp[step]) <= 1e-5 * abs(fsdp[step])
