"""For the recovery tests: SIGKILL a train.py rank of one torchrun once its launch has trained a few steps, as a
crashed GPU or an OOM kill ends a rank, with no test-only code in train.py.

    python tests/kill_rank.py TORCHRUN_PID METRICS_JSONL STEPS [ONCE_FILE]

It waits for STEPS new training records in METRICS_JSONL (rank 0 writes them, on whichever node), then kills a
train.py child of TORCHRUN_PID and writes the kill's time (unix s) to ONCE_FILE: with ONCE_FILE, only the first
kill of all launches happens (created exclusively); without, every launch loses a rank. Gives up with torchrun.
"""

import os
import signal
import sys
import time


def records(metrics: str) -> int:
    try:
        with open(metrics) as f:
            return sum('"loss"' in line for line in f)
    except OSError:
        return 0


def ranks(torchrun_pid: int) -> list:
    """torchrun's train.py children (it starts each rank as a subprocess)."""
    children = []
    for task in os.listdir(f"/proc/{torchrun_pid}/task"):
        with open(f"/proc/{torchrun_pid}/task/{task}/children") as f:
            children += map(int, f.read().split())
    found = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"train.py" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return sorted(found)


def kill_after(torchrun_pid: int, metrics: str, steps: int, once: str = "", timeout: float = 600):
    """The time of the kill, or None (torchrun ended first, or another launch already had its kill)."""
    seen = records(metrics)  # an earlier launch's records
    deadline = time.time() + timeout
    while time.time() < deadline and os.path.exists(f"/proc/{torchrun_pid}"):
        found = ranks(torchrun_pid) if records(metrics) - seen >= steps else []
        if found:
            if once:
                try:
                    fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    return None
            os.kill(found[-1], signal.SIGKILL)
            killed = time.time()
            if once:
                os.write(fd, f"{killed}\n".encode())
                os.close(fd)
            return killed
        time.sleep(0.05)
    return None


if __name__ == "__main__":
    kill_after(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
