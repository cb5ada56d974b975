"""The process the tests fork training runs from (conftest.start_training). It imports train.py once, then
reads requests from stdin, a JSON line each: [program, argv, environment, nproc, timeout, result file]. For each it
forks nproc ranks that run `program argv` as __main__, each with the request's environment (the caller's at that
call) and what torchrun gives a rank, and once all have ended writes what the launch exits with to the result file:
`python program`'s own code for one rank, torchrun's 1 when any of several failed. Their stdout and stderr go to
the result file's name + .out and .err. Runs may overlap. When stdin closes it kills the ranks still running, and
ends."""

import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback

import torch

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # as for `python train.py` in the repo
import train  # noqa: E402,F401  everything train.py imports, once

# A variable these read at import (HF_ENDPOINT, HF_HOME) must reach a rank's own import of them
early = [name for name in ("huggingface_hub", "datasets") if name in sys.modules]
assert not early, f"train.py's imports now import {early}: import them where they are used, as pretrain/sources.py does"

GRACE = 30  # seconds between the SIGTERM that ends the other ranks of a failed run and a SIGKILL (torchrun's)


def rank(program: str, argv: list, env: dict, nproc: int, timeout: int, r: int, port: int, result: str):
    """The forked child: rank r of nproc. Never returns."""
    os.dup2(os.open(result + ".out", os.O_WRONLY | os.O_APPEND), 1)
    os.dup2(os.open(result + ".err", os.O_WRONLY | os.O_APPEND), 2)
    # The caller's environment at this call, not this process's (the first caller's, with what a test had
    # monkeypatched then): a launched program gets its launcher's
    os.environ.clear()
    os.environ.update(env)
    if nproc > 1:
        os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several ranks
    # OpenMP read OMP_NUM_THREADS when this process imported torch: set the rank's own
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads:
        torch.set_num_threads(int(threads))
    signal.alarm(timeout)  # a hung run ends when the test stops waiting for it
    sys.argv = [program, *argv]
    try:
        runpy.run_path(program, run_name="__main__")
        code = 0
    except SystemExit as e:  # sys.exit(code), or argparse's exit 2 with its message already printed
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()  # a bug: its traceback, as `python program` prints it
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start(request: bytes) -> list:
    """Fork the request's ranks: [{pid: exit code or None}, when the others got SIGTERM or None]."""
    program, argv, env, nproc, timeout, result = json.loads(request)
    with socket.socket() as s:  # a free port for rank 0's store, as `torchrun --standalone` finds one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = {}
    for r in range(nproc):
        pid = os.fork()
        if pid == 0:
            rank(program, argv, env, nproc, timeout, r, port, result)
        pids[pid] = None
    return [pids, None]


def reap(job: list) -> bool:
    """Collect the job's ended ranks; stop the rest when one failed, as torchrun does. True once all ended."""
    pids = job[0]
    for pid in pids:
        if pids[pid] is None:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                pids[pid] = os.waitstatus_to_exitcode(status)
    running = [pid for pid, code in pids.items() if code is None]
    if running and any(pids.values()):
        if job[1] is None:
            job[1] = time.monotonic()
        late = time.monotonic() - job[1] > GRACE
        for pid in running:
            os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
    return not running


def exit_code(codes: list) -> int:
    """What the launch exits with, given its ranks' codes."""
    if -signal.SIGALRM in codes:  # a rank outlived the run's timeout: Run.wait raises TimeoutExpired
        return -signal.SIGALRM
    if len(codes) == 1:  # `python program`: its own code
        return codes[0]
    return int(any(codes))  # torchrun: 1 when a rank failed (its report, which tests read, gives each code)


def main():
    jobs = {}  # result file -> start()'s job
    pending = b""
    try:
        while True:
            if select.select([0], [], [], 0.05)[0]:
                chunk = os.read(0, 65536)
                if not chunk:
                    return  # the tests have ended (or their process died)
                pending += chunk
                while b"\n" in pending:
                    request, pending = pending.split(b"\n", 1)
                    jobs[json.loads(request)[-1]] = start(request)
            for result, job in list(jobs.items()):
                if reap(job):
                    with open(result + ".tmp", "w") as f:
                        f.write(str(exit_code(list(job[0].values()))))
                    os.rename(result + ".tmp", result)  # whole, or not there yet
                    del jobs[result]
    finally:  # no rank outlives this process, which alone waits for them
        for job in jobs.values():
            for pid in (pid for pid, code in job[0].items() if code is None):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
