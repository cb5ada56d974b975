"""preflight.py dryrun (pretrain/dryrun.py) against real runs, on layouts that run here: its peak per rank, counted on fake
tensors, is within BOUND of the real trainer's peak, counted the same way (memory.LiveStorages: the bytes of live
tensor storages at every op) around train.main on real tensors, three steps (AdamW's moments exist from step 1's
optimizer.step on, so steps 2 and 3 are the steady state the dry run's two steps must reach), gloo. And a mistake
that only shows at the target size (2,048 ranks), or only on the job's GPUs, ends it with train.py's one `error:`
line and exit code 2.

Run as a script (under torchrun, or plain python for one process) this file is the real side: `python
tests/test_dryrun.py DUMP JSON` runs train.main once per argument list in JSON, writing DUMP/peak-i-r.json per
run i and rank r: {"real": i, "rank": r, "peak": bytes}.
"""

import glob
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conftest import SMALL, run_training  # noqa: E402
import train  # noqa: E402  (the trainer the dry run is handed, as preflight.py hands it)

# The SMALL shape (2 blocks, seq 64), not the debug model's 6 blocks at seq 256: the three real steps and the
# dry run's two cost a fraction of one step of 6 blocks; both sides count the same storages at any shape. Three
# steps: the dry run checks the phases a run reaches (the config's [[phases]] begin at step 31).
DEBUG = ["--config", os.path.join(ROOT, "configs/debug_model.toml"), "--training.local_batch_size", "4",
         *SMALL, "--training.steps", "3"]
FULL, SAC = ["--activation_checkpoint.mode", "full"], ["--activation_checkpoint.mode", "selective"]
FLOAT8 = ["--model.converters", "float8"]
# (world size, arguments): 1 process, FSDP 2, TP 2, HSDP 2 x 1; AC none, selective and full; float8 on two of them
ONE = [FLOAT8]
TWO = [SAC, ["--parallelism.tensor_parallel_degree", "2", *FULL, *FLOAT8],
       ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]]
# |dry run - real| / real, per rank: what it measured is in docs/performance.md#dry-run; the old 1-step dry
# run was far outside it (no optimizer state in its peak)
BOUND = 0.02


def real_runs(dump: str, runs: list):
    import torch.distributed as dist

    from pretrain import memory
    import train
    for i, extra in enumerate(runs):
        if i and "MASTER_PORT" in os.environ:  # torchrun's store keeps the first group's keys: a new store each run
            os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + 1))
        cfg = train.load_config([*DEBUG, *extra, "--job.dump_folder", os.path.join(dump, str(i)), "--training.steps",
                                 "3", "--checkpoint.enable", "false", "--validation.enable", "false"])
        with memory.LiveStorages() as counter:
            train.main(cfg)
        with open(os.path.join(dump, f"peak-{i}-{os.environ.get('RANK', 0)}.json"), "w") as f:  # ranks share stdout
            json.dump({"real": i, "rank": int(os.environ.get("RANK", 0)), "peak": counter.peak}, f)
    assert not dist.is_initialized()


def launch(dump, runs: list, nproc: int) -> dict:
    proc = run_training([dump, json.dumps(runs)], nproc, program=__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.load(open(p)) for p in glob.glob(os.path.join(dump, "peak-*.json"))]
    return {(r["real"], r["rank"]): r["peak"] for r in lines}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """{(layout, rank): peak bytes} of the real runs: one launch for 1 process, one for the 2-process layouts."""
    out = {(("one", i), r): v for (i, r), v in launch(tmp_path_factory.mktemp("one"), ONE, 1).items()}
    return out | {(("two", i), r): v for (i, r), v in launch(tmp_path_factory.mktemp("two"), TWO, 2).items()}


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """{(layout, world size, index): dryrun.dry_run's results (a dict per rank: peak, phase, checkpoint items)}."""
    from pretrain import dryrun
    import train
    out = {}
    for name, world, runs in (("one", 1, ONE), ("two", 2, TWO)):
        for i, extra in enumerate(runs):
            cfg = train.load_config([*DEBUG, *extra, "--job.dump_folder", str(tmp_path_factory.mktemp("dry"))])
            out[name, world, i] = dryrun.dry_run(cfg, world, train)
            assert not [r for r in out[name, world, i] if "error" in r], out[name, world, i]
    return out


@pytest.mark.slow
def test_dry_run_peak_is_the_real_peak_per_rank(real, dry):
    phases = {r["peak_phase"] for results in dry.values() for r in results}
    assert phases == {"forward and backward of step 2"}, phases  # the first step with AdamW's moments
    dry = {((name, i), r["rank"]): r["peak"] for (name, _, i), results in dry.items() for r in results}
    assert set(real) == set(dry) and len(real) == 1 + 2 * len(TWO)
    report = {str(k): (dry[k], real[k], f"{dry[k] / real[k] - 1:+.2%}") for k in sorted(real)}
    print(json.dumps(report, indent=1))
    for key in real:
        assert abs(dry[key] - real[key]) <= BOUND * real[key], report


@pytest.mark.parametrize("extra, line", [
    (["--config", "configs/llama3_405b.toml", "--training.global_batch_size", "1000"],
     "error: training.global_batch_size = 1000 must be a multiple of local_batch_size 2 x data-parallel degree 256"),
    (["--config", "configs/llama3_405b.toml", "--parallelism.tensor_parallel_degree", "16"],
     "error: parallelism.tensor_parallel_degree = 16 must divide the 405B model's n_heads 128 and n_kv_heads 8"),
    # a GPU-only rule: the CPU's float8 emulation takes fp32 parameters, an H100's rowwise float8 matmuls do not
    (["--config", "configs/llama3_405b.toml", "--model.converters", "float8", "--float8.recipe_name", "rowwise",
      "--training.mixed_precision_param", "float32"],
     "error: float8.recipe_name = 'rowwise' needs training.mixed_precision_param = bfloat16 on a GPU (rowwise float8 "
     "matmuls write bf16; it is float32)"),
])
def test_a_mistake_at_2048_ranks_is_the_trainers_one_line(extra, line, capsys):
    import preflight
    with pytest.raises(SystemExit) as e:
        preflight.main(["dryrun", "--world_size", "2048", *extra])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err == line + "\n" and out == ""


def test_the_rules_are_the_targets_not_this_machines_gpu(monkeypatch, capsys):
    """A laptop whose GPU lacks float8 matmuls (an A100-class SM 8.0) dry-runs a float8 config for an H100 cluster:
    the GPU rules are the job's (float8.check(gpu=True)), and this machine's GPU is never asked. The forked ranks
    are left out (test_dry_run_peak_is_the_real_peak_per_rank runs float8 ones): validate and the report."""
    import torch

    from pretrain import dryrun
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: asked.append(a) or (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    fake = [{"rank": r, "peak": 20 * dryrun.GIB, "peak_phase": "forward and backward of step 2", "setup": 0,
             "after": 0, "items": 1, "written": 0} for r in (0, 63)]
    monkeypatch.setattr(dryrun, "dry_run", lambda cfg, world, trainer: fake)
    code = dryrun.run(64, ["--config", os.path.join(ROOT, "configs/llama3_8b.toml"), *FLOAT8], train)
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and ", float8;" in out, out + err
    assert asked == []


def test_each_phase_is_a_line_on_stderr_as_it_ends(capfd, tmp_path):
    """The forked ranks say where they are: a dry run at 2,048 ranks takes minutes."""
    from pretrain import dryrun
    import train
    cfg = train.load_config([*DEBUG, "--job.dump_folder", str(tmp_path), "--training.seq_len", "64"])
    assert "error" not in dryrun.dry_run(cfg, 1, train)[0]
    err = capfd.readouterr().err
    phases = re.findall(r"^dryrun: rank 0: (.+) \d+\.\ds$", err, re.M)
    assert phases == ["build", "parallelize", "step 1", "step 2", "plan"], err


@pytest.mark.slow
def test_the_report(dry, monkeypatch, capsys, tmp_path):
    """The report of the TP 2 layout's dry run (its results from the fixture: dry_run is not run twice)."""
    from pretrain import dryrun
    monkeypatch.setattr(dryrun, "dry_run", lambda cfg, world, trainer: dry["two", 2, 1])
    code = dryrun.run(2, [*DEBUG, *TWO[1], "--job.dump_folder", str(tmp_path)], train)
    out = capsys.readouterr().out
    assert code == 0, out
    for text in ("world 2 = dp_replicate 1 x dp_shard 1 x tp 2", "rank 0: peak", "rank 1: peak", "checkpoint: ",
                 "two steps, the second holding the optimizer's state", "in forward and backward of step 2 (after set-up",
                 "not counted: NCCL's buffers, the CUDA context, the caching allocator's fragmentation, compile's "
                 "workspaces, a validation or eval round; \"fits\" keeps 20% of the GPU free for them",
                 "activation checkpoint full, float8", "bench.py memory's memory estimate per device",
                 "H100 80 GB: fits", "H200 141 GB: fits", "dryrun took"):
        assert text in out, out


if __name__ == "__main__":
    real_runs(sys.argv[1], json.loads(sys.argv[2]))
