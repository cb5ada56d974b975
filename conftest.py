"""What test_smoke.py and tests/ share: one thread a process in the whole suite; training runs forked
from one process that imported train.py (run_training); the reference runs, each ~10 s, run once; the
tests marked starts_early first; and the two tiers' times at the end of every run.

Training tests pass --validation.enable false: the held-out rounds (about 2 s a run) are tested in
tests/test_validation.py, and they would add minutes to the suite."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))

# The whole suite runs a test file per core (pytest-xdist): there every process, and each it starts, gets
# one thread, as torchrun gives each of several ranks. Two threads would spin on a core the other file's
# process holds, for the same losses (docs/performance.md#the-test-suite). The quick tier runs in one
# process and keeps both cores. Set before torch's import.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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


# --- Training runs forked from one process that imported train.py once (tests/fork_server.py). A run
# launched for real pays for its imports on every rank (~3 s of CPU each) and for torchrun's (~2.5 s):
# a 2-rank run of 10 small steps costs ~17 s of CPU, half of it imports. Forked, a training program
# (train.py or a fork of it) runs as __main__ with what torchrun gives each rank: RANK, WORLD_SIZE and
# MASTER_* in its environment, one thread, SIGTERM when another rank fails. Tests of torchrun itself
# (restarts, signals to the launcher, a killed rank) launch it for real, as do runs that need a fresh
# interpreter: an edited copy of the repo, memory measured by the process, a resource limit.
_forking = []  # that process, started by the first run of this pytest worker


class Run:
    """A training program started by start_training(): wait() gives a subprocess.CompletedProcess."""

    def __init__(self, program, argv, env, nproc, timeout):
        if not _forking:
            server = os.path.join(ROOT, "tests", "fork_server.py")
            _forking.append(subprocess.Popen([sys.executable, server], cwd=ROOT, stdin=subprocess.PIPE))
        folder = tempfile.mkdtemp(prefix="run-")
        self.result = os.path.join(folder, "code")
        open(self.result + ".out", "w").close()
        open(self.result + ".err", "w").close()
        self.args = [program, *argv]
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        environ = dict(os.environ)  # this call's, with what the test monkeypatched, as a launch would get it
        for key, value in (env or {}).items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        request = [program, [str(a) for a in argv], environ, nproc, int(timeout), self.result]
        _forking[0].stdin.write((json.dumps(request) + "\n").encode())
        _forking[0].stdin.flush()

    def wait(self) -> subprocess.CompletedProcess:
        while not os.path.exists(self.result):
            assert _forking[0].poll() is None, "tests/fork_server.py ended: its error is on this worker's stderr"
            # the ranks' alarm (from their fork, after the process's own start) has not ended them
            if time.monotonic() > self.deadline + 60:
                raise subprocess.TimeoutExpired(self.args, self.timeout)
            time.sleep(0.05)
        with open(self.result) as f:
            code = int(f.read())
        with open(self.result + ".out") as f:
            out = f.read()
        with open(self.result + ".err") as f:
            err = f.read()
        shutil.rmtree(os.path.dirname(self.result))
        if code == -signal.SIGALRM:  # the ranks' alarm: the run outlived its timeout, as subprocess.run says it
            raise subprocess.TimeoutExpired(self.args, self.timeout, out, err)
        return subprocess.CompletedProcess(self.args, code, out, err)


def start_training(argv, nproc=1, program="train.py", env=None, timeout=600) -> Run:
    """`torchrun --nproc_per_node nproc program argv` (`python program argv` for 1), forked as above, in
    the repo's folder, with this process's environment; env: variables to set in it (None: unset). Its
    exit code is the launch's: the program's for 1, torchrun's 1 when any of several ranks failed."""
    return Run(program, argv, env, nproc, timeout)


def run_training(argv, nproc=1, program="train.py", env=None, timeout=600) -> subprocess.CompletedProcess:
    """start_training(), then wait for it: stdout and stderr hold every rank's, as under torchrun."""
    return start_training(argv, nproc, program, env, timeout).wait()


def pytest_sessionfinish():
    for proc in _forking:
        proc.stdin.close()  # its loop ends
        proc.wait(timeout=60)


def _train_2proc(dump, *args):
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
            "--metrics.log_freq", "1", "--validation.enable", "false", "--training.steps", "10",
            *SMALL, *args]
    proc = run_training(argv, nproc=2)
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


def titan_names(sd: dict, version: str) -> dict:
    """Meta's names as torchtitan `version` calls them: 0.3.0 puts q, k and v under qkv_linear and calls the
    output layer lm_head (written out here, not taken from pretrain/titan_layout.py)."""
    if version == "0.2.2":
        return dict(sd)
    rename = {f".attention.{p}.": f".attention.qkv_linear.{p}." for p in ("wq", "wk", "wv")}
    out = {}
    for k, w in sd.items():
        for old, new in rename.items():
            k = k.replace(old, new)
        out["lm_head.weight" if k == "output.weight" else k] = w
    return out
