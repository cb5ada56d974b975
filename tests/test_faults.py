"""Which kind of failure an error is (pretrain/faults.py): the user's (exit 2), or a fault of the infrastructure or of
one node (exit 4, restarted by slurm/multinode.sbatch, without the node the line names)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pretrain import faults, sources  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402
from pretrain.distributed import raise_first  # noqa: E402


@pytest.mark.parametrize("errors, kind, line", [
    # (line, fault, node) of each rank: two ranks on n0, two on n1
    ([("bad key", False, "n0"), ("", False, "n0"), ("", False, "n1"), ("", False, "n1")], ConfigError, "bad key"),
    ([("", False, "n0"), ("", False, "n0"), ("Hub timed out", True, "n1"), ("", False, "n1")], faults.Fault,
     "node n1: Hub timed out"),
    ([("Hub timed out", True, "n0"), ("", False, "n0"), ("Hub timed out", True, "n1"), ("", False, "n1")],
     faults.Fault, "Hub timed out"),  # every node: none to leave out, and a restart may still do
    ([("", False, "n0"), ("", False, "n0"), ("", False, "n1"), ("file missing", "node", "n1")], faults.Fault,
     "node n1: file missing"),  # one node's copy
    ([("file missing", "node", "n0"), ("", False, "n0"), ("file missing", "node", "n1"), ("", False, "n1")],
     ConfigError, "file missing"),  # every node's: the user's to put back
])
def test_the_first_error_is_raised_as_its_kind_naming_the_one_node_that_saw_it(errors, kind, line):
    with pytest.raises(kind) as e:
        raise_first(errors)
    assert str(e.value) == line and faults.is_fault(e.value) == (kind is faults.Fault)


class Response:
    def __init__(self, status):
        self.status_code = status


class HTTPError(OSError):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.response = Response(status)


def test_a_read_that_kept_failing_is_a_fault_a_refused_or_damaged_one_the_users():
    def raised(e, failures):
        with pytest.raises(sources.DataError) as caught:
            sources.retry_or_raise("c4", "allenai/c4", "reading a file", e, failures)
        return caught.value
    assert raised(TimeoutError("read timed out"), len(sources.RETRY_DELAYS)).fault  # every retry spent
    assert raised(HTTPError(503), len(sources.RETRY_DELAYS)).fault
    assert not raised(HTTPError(404), 0).fault  # the dataset id or revision: the user's
    assert not raised(OSError("Not a gzipped file"), 0).fault  # damaged: no retry mends it


# float8 rowwise in fp32: a GPU's float8 matmuls refuse it (they write bf16); this CPU machine would not know
ROWWISE_FP32 = ["--model.converters", "float8", "--float8.recipe_name", "rowwise",
                "--training.mixed_precision_param", "float32"]


def test_the_jobs_gpus_decide_its_rules_in_bench_memory_and_download_data_not_this_machine(tmp_path, capsys,
                                                                                           monkeypatch):
    pytest.importorskip("torchao")
    import bench
    import download_data
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        bench.main(["memory", "--config", "configs/llama3_8b.toml", "--world_size", "8", *ROWWISE_FP32])
    assert e.value.code == 2 and "needs training.mixed_precision_param = bfloat16 on a GPU" in capsys.readouterr().err
    monkeypatch.setattr(download_data, "download", lambda *a: pytest.fail("it went on to download"))
    with pytest.raises(ConfigError, match="needs training.mixed_precision_param = bfloat16 on a GPU"):
        download_data.main(["--config", "configs/llama3_8b.toml", "--world_size", "8", "--to", str(tmp_path),
                            *ROWWISE_FP32])


def test_a_steps_reads_are_bounded_as_a_whole_over_its_micro_batches():
    """train.read_step reads grad_accum micro-batches before any collective: their reads share one deadline,
    comm.init_timeout_seconds from the step's start (a Hub read checks it before each range, as this loader)."""
    import time

    import torch

    import data
    import train
    from pretrain import phases

    class SlowHub:  # each batch's reads take 0.6 s, each within the loader's budget of 1 s
        step = [float("inf"), float("inf")]
        budget = 1.0  # comm.init_timeout_seconds
        local_batch_size = 1
        reads_within = data.DataLoader.reads_within  # the loader's deadline, as DataLoader keeps it

        def __next__(self):
            time.sleep(0.6)
            if time.monotonic() > self.step[0]:
                raise sources.DataError("the reads of one step took longer than comm.init_timeout_seconds",
                                        fault=True)
            return torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)

    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--training.seq_len", "8",
                             "--training.local_batch_size", "1", "--comm.init_timeout_seconds", "1"])
    args = train.model_args(cfg)
    one, two = (phases.Stage(index=0, first_step=1, global_batch_size=n, seq_len=8, grad_accum=n, weights=(1.0,),
                             anneal=False, tokens_before=0) for n in (1, 2))  # the step's phase: n micro-batches
    batches, error, _ = train.read_step(SlowHub(), one, args, torch.device("cpu"))
    assert len(batches) == 1 and error == ""
    hub = SlowHub()
    batches, error, _ = train.read_step(hub, two, args, torch.device("cpu"))
    assert len(batches) == 2 and faults.is_fault(error) and "took longer" in str(error)  # the second ran past
    assert hub.step[0] == float("inf")  # outside a step, no deadline


def stale_view(argv):
    """train.py as two nodes (node0, node1: one rank each), node 1 seeing a stale checkpoint folder: its
    .metadata cannot be read there, while rank 0 finds the checkpoint complete."""
    import runpy

    import torch.distributed.checkpoint as dcp
    rank = os.environ["RANK"]
    os.environ["SLURMD_NODENAME"] = f"node{rank}"
    if rank == "1":
        def stale(self):
            raise OSError(116, "Stale file handle")
        dcp.FileSystemReader.read_metadata = stale
    # train.py as __main__ (sys.argv is this program's): its one line and exit code
    runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")


@pytest.mark.slow
def test_a_node_with_a_stale_view_of_the_checkpoint_folder_is_a_fault_that_names_it(tmp_path):
    from conftest import SMALL, run_training
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", tmp_path, "--training.steps", "2",
            "--validation.enable", "false", "--checkpoint.enable", "--training.local_batch_size", "4", *SMALL]
    assert run_training(argv, 2).returncode == 0
    # on real torchrun, whose report gives each rank's exit code
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, *map(str, argv[:5]), "4", *argv[6:]], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CHECK": "stale_view"}, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert "exitcode  : 4" in proc.stderr and "[rank1]:" not in proc.stderr, proc.stderr[-3000:]  # no rank's traceback
    assert lines[0].endswith(f"error: node node1: rank 1 cannot read {tmp_path}/checkpoint/step-2/.metadata, which "
                             "rank 0 found complete (OSError: [Errno 116] Stale file handle)"), lines


def slow_listing(argv):
    """train.py whose rank 0 takes 4 s to list the checkpoint folder at the resume (a busy filesystem),
    counting the .metadata reads of its resume into DUMP/reads."""
    import time

    import torch.distributed.checkpoint as dcp

    import train
    cfg = train.load_config(argv)
    if os.environ["RANK"] == "0":
        listdir, read = os.listdir, dcp.FileSystemReader.read_metadata

        def slow(path="."):
            if str(path).endswith("checkpoint"):
                time.sleep(4)
                os.listdir = listdir  # the resume's listing only
            return listdir(path)

        def counted(self):
            if os.listdir is listdir:  # the resume's reads, before training saves
                with open(os.path.join(cfg.job.dump_folder, "reads"), "a") as f:
                    f.write(f"{self.path}\n")
            return read(self)
        os.listdir, dcp.FileSystemReader.read_metadata = slow, counted
    train.main(cfg)


@pytest.mark.slow
def test_rank_0_lists_the_checkpoints_while_the_others_wait_in_the_store_and_reads_the_chosen_one_once(tmp_path):
    """The listing at resume outlasts comm.init_timeout_seconds (2 s) and the others wait for it in the job's
    store, up to checkpoint.save_timeout_seconds; of 4 checkpoints only the newest is read: once to choose it,
    once to check that it fits, once by DCP's load."""
    from conftest import SMALL, run_training
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", tmp_path, "--training.steps", "4",
            "--validation.enable", "false", "--checkpoint.enable", "--checkpoint.interval", "1",
            "--training.local_batch_size", "4", *SMALL]
    assert run_training(argv, 2).returncode == 0
    proc = run_training([*argv[:5], "5", *argv[6:], "--comm.init_timeout_seconds", "2"], 2, program=__file__,
                        env={"CHECK": "slow_listing"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = (tmp_path / "reads").read_text().split()
    assert reads == [str(tmp_path / "checkpoint" / "step-4")] * 3, reads


if __name__ == "__main__":
    globals()[os.environ["CHECK"]](sys.argv[1:])
