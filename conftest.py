"""Reference training runs shared by test_smoke.py and tests/: each costs ~10 s, run once; the
tests marked starts_early first; and the two tiers' times at the end of every run.

Training tests pass --validation.enable false: the held-out rounds (about 2 s a run) are tested in
tests/test_validation.py, and they would add minutes to the suite."""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# One test body for every device: `@pytest.mark.parametrize("device", DEVICES)` runs it on the CPU
# here and, unchanged, on a GPU under `python -m pytest -m gpu` (the cuda case is marked `gpu` and
# skipped without CUDA).
GPU_SKIP = "needs a CUDA GPU; on a GPU node run: python -m pytest -m gpu"
_CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason=GPU_SKIP)]
DEVICES = ["cpu", pytest.param("cuda", marks=_CUDA_MARKS)]


# Test runs train the debug model smaller than configs/debug_model.toml: 2 of its blocks at 64 tokens
# a sequence take 0.15 s a step on one core here, its 6 blocks at 256 tokens 1.6 s. Every run whose
# losses a test compares with another one's passes the same shape.
SMALL = ("--model.n_layers", "2", "--training.seq_len", "64")


def _train_2proc(dump, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
           "--metrics.log_freq", "1", "--validation.enable", "false", "--training.steps", "10",
           *SMALL, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dump, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory):
    """(dump folder, stdout + stderr) of 10 steps on 2 ranks, FSDP, global batch 8, checkpoints at 5
    and 10; the SMALL shape."""
    return _train_2proc(tmp_path_factory.mktemp("ref_fsdp"), "--training.local_batch_size", 4,
                        "--checkpoint.enable", "--checkpoint.interval", 5)


@pytest.fixture(scope="session")
def tp_reference(tmp_path_factory):
    """(dump folder, stdout + stderr) of 10 steps on 2 ranks, tensor parallel 2, selective AC,
    global batch 8; the SMALL shape."""
    dump = tmp_path_factory.mktemp("ref_tp")
    return _train_2proc(dump, "--parallelism.tensor_parallel_degree", 2,
                        "--activation_checkpoint.mode", "selective")


def pytest_collection_modifyitems(items):
    """Tests marked starts_early run first: they start work that takes minutes of waiting (tests/test_slurm.py's
    jobs), which the rest of the suite fills; the tests that collect it come later."""
    items.sort(key=lambda item: item.get_closest_marker("starts_early") is None)  # stable: the rest in order


# --- Two tiers: `python -m pytest -q -m "not slow"` after an edit, the whole suite in CI. A feature
# that adds tests pays for them: its quick cases within QUICK_BUDGET, the rest marked slow, the
# whole within WHOLE_BUDGET (2 cores).
QUICK_BUDGET = 90     # seconds, summed over the quick tests' setup, call and teardown
WHOLE_BUDGET = 1200   # seconds of wall time for the whole suite
_seconds = {"quick": 0.0, "slow": 0.0, "start": time.perf_counter()}


def pytest_runtest_logreport(report):  # setup, call and teardown of every test, by tier
    _seconds["slow" if "slow" in report.keywords else "quick"] += report.duration


@pytest.hookimpl(trylast=True)  # after the slowest tests' list
def pytest_terminal_summary(terminalreporter):
    quick = _seconds["quick"]
    slow = _seconds["slow"]
    whole = time.perf_counter() - _seconds["start"]
    over = []
    # The quick tier alone: in the whole suite its tests share the machine with the starts_early work
    if quick > QUICK_BUDGET and slow == 0:
        over.append(f"quick tier over {QUICK_BUDGET} s")
    if whole > WHOLE_BUDGET and slow > 0:  # a session without slow tests is not the whole suite
        over.append(f"whole suite over {WHOLE_BUDGET} s")
    verdict = "; OVER: " + ", ".join(over) if over else ""
    line = (f"tiers: the quick tests (-m \"not slow\") {quick:,.0f} s (budget {QUICK_BUDGET}), "
            f"the slow ones {slow:,.0f} s; this session {whole:,.0f} s wall "
            f"(whole suite budget {WHOLE_BUDGET}){verdict}")
    terminalreporter.write_line(line)
