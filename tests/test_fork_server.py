"""tests/fork_server.py, which forks the tests' training runs, launches as torchrun and `python` do where a test
can tell: the exit code, the environment of the call, no rank left running when the tests end."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from conftest import run_training  # noqa: E402

# Rank r exits with argv[r] after printing PROBE; with a file name in HOLD, it writes its pid there and waits.
PROGRAM = """
import os
import sys
import time

rank = int(os.environ.get("RANK", 0))
print(f"rank {rank}: PROBE={os.environ.get('PROBE', 'unset')}", flush=True)
if os.environ.get("HOLD"):
    with open(os.environ["HOLD"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.environ["HOLD"] + ".tmp", os.environ["HOLD"])
    time.sleep(120)
sys.exit(int(sys.argv[1 + rank]))
"""


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text(PROGRAM)
    return str(path)


def test_the_exit_code_is_the_launchs(program):
    """`python program` exits with the program's code; torchrun with 1 when any rank failed (the harness said
    the failed rank's 7)."""
    assert run_training(["7"], program=program).returncode == 7
    assert run_training(["0", "7"], nproc=2, program=program).returncode == 1
    assert run_training(["0", "0"], nproc=2, program=program).returncode == 0


@pytest.mark.slow
def test_torchrun_exits_alike(program):
    """What the test above holds the harness to: torchrun's own code for the same ranks."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           program, "0", "7"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "exitcode  : 7" in proc.stderr, proc.stderr[-3000:]


def test_a_run_gets_the_environment_of_its_call(program, monkeypatch):
    """The server forks from the process the first run started, with that run's environment: each run must get
    the variables as they are at its own call, as a launched program does."""
    for value in ("first", "second"):
        monkeypatch.setenv("PROBE", value)
        out = run_training(["0", "0"], nproc=2, program=program).stdout
        assert sorted(out.splitlines()) == [f"rank 0: PROBE={value}", f"rank 1: PROBE={value}"]
    assert run_training(["0"], program=program, env={"PROBE": None}).stdout == "rank 0: PROBE=unset\n"
    monkeypatch.delenv("PROBE")
    assert run_training(["0"], program=program).stdout == "rank 0: PROBE=unset\n"


def alive(pid):
    """Running, not exited (a zombie waiting to be reaped has exited)."""
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # a server of its own: ~3 s importing train.py
def test_the_ranks_end_with_the_server(program, tmp_path):
    """A pytest worker that ends (or dies) closes the server's stdin: the ranks still running end with it, not
    minutes later at their alarm, holding cores and ports the next tests need."""
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fork_server.py")], cwd=ROOT,
                              stdin=subprocess.PIPE)
    hold = tmp_path / "pid"
    result = tmp_path / "code"
    for suffix in (".out", ".err"):
        open(str(result) + suffix, "w").close()
    request = [program, ["0"], {"HOLD": str(hold)}, 1, 600, str(result)]  # the environment: HOLD alone
    server.stdin.write((json.dumps(request) + "\n").encode())
    server.stdin.flush()
    deadline = time.monotonic() + 60
    while not hold.exists():
        assert server.poll() is None and time.monotonic() < deadline, open(str(result) + ".err").read()
        time.sleep(0.05)
    rank = int(hold.read_text())
    server.stdin.close()
    server.wait(timeout=30)
    try:
        assert not alive(rank)
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGKILL)
