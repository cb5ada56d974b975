"""slurm/multinode.sbatch's bookkeeping: what a failed launch cost, what the script does next, and
the job's goodput.

The script calls it; a person reads its lines in the job's log. The job's record (when it first
started, its failures, the nodes left out) is a JSON file next to the log, which outlives the job's
requeues. It imports no torch: it runs between a failure and the next launch, where every second
counts.

    python slurm/recover.py start RECORD --job JOBID          # at every start of the job
    python slurm/recover.py failed RECORD --log LOG --offset N --since T \
        --nodes "n1 n2" --spares "n3" --down ""
    python slurm/recover.py end RECORD --log LOG --offset N   # the goodput line, also into metrics.jsonl

`failed` reads the log from byte N (where the launch began), names the failed node and prints on
stdout what to do: `spare NODE SPARE` (relaunch with SPARE in place of NODE), `relaunch` (same
nodes), `requeue [NODE]`, `stop CODE`.
"""

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
import tomllib

# the lines of a rank that lost its peer (pretrain/distributed.py's lost_rank)
LOST = ("lost its connection to another rank", "for a rank that never joined it")


def say(line: str):
    print(f"{time.strftime('%F %T')} multinode.sbatch: {line}", file=sys.stderr, flush=True)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save(record: dict, path: str):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)  # a job killed mid-write keeps the previous record


# -------------------------------------------------------------------------------------------------
# start: the job's record
# -------------------------------------------------------------------------------------------------

def start(path: str, job: str):
    """The job's record at `path`, made at its first start; every start (1 + its requeues)
    counts."""
    old = load(path) if os.path.exists(path) else {}
    record = old
    if old.get("job") != job:  # another job's record: a log name without %j
        record = {"job": job, "first_start": time.time(), "starts": 0, "failures": [], "restarts": 0,
                  "left_out": [], "stalled": 0, "dump_folder": ""}
    record["starts"] += 1
    save(record, path)


def dump_folder(record: dict, lines: list) -> str:
    """The run's dump folder, from train.py's first log line ("...; config in DUMP/config.toml"):
    neither the script nor this program reads train.py's config (that would import torch)."""
    for line in lines:
        if m := re.search(r"; config in (.+)/config\.toml$", line):
            record["dump_folder"] = m[1]
    return record["dump_folder"]


# -------------------------------------------------------------------------------------------------
# failed: which node, how, and what next
# -------------------------------------------------------------------------------------------------

def newest_checkpoint(dump: str) -> int:
    """The newest step-N with DCP's .metadata, the mark of a complete save (train.py's resume checks
    more)."""
    folder = "checkpoint"
    try:
        with open(os.path.join(dump, "config.toml"), "rb") as f:
            folder = tomllib.load(f).get("checkpoint", {}).get("folder", folder)
    except (OSError, tomllib.TOMLDecodeError):
        pass
    folder = os.path.join(dump, folder)
    names = os.listdir(folder) if dump and os.path.isdir(folder) else []
    steps = [int(m[1]) for d in names if (m := re.fullmatch(r"step-(\d+)", d))]
    complete = [s for s in steps if os.path.isfile(os.path.join(folder, f"step-{s}", ".metadata"))]
    return max(complete, default=0)


def trained_records(metrics: str, since: float) -> list:
    """Training records (step, time) that metrics.jsonl got at or after `since`, in file order."""
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    return [(r["step"], r["time"]) for r in records if r.get("time", 0) >= since]


def how_it_ended(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def reports(lines: list) -> tuple:
    """What each srun task (node) said: torchrun's (rank, exit code) per failed rank, train.py's
    `error:` lines, and srun's own `error: NODE: task N: ...` lines (node, line), in log order."""
    ranks, codes, errors, sruns = {}, {}, {}, []
    for line in lines:
        if m := re.match(r"srun: error: (\S+): tasks? [\d\-,]+: ", line):
            sruns.append((m[1], line.strip()))
        if not (m := re.match(r"(\d+): (.*)", line)):  # srun --label: the task's index
            continue
        task, text = int(m[1]), m[2]
        if e := re.match(r"error: (.*)", text):
            errors.setdefault(task, []).append(e[1])
        elif r := re.match(r"\s+rank\s*: (\d+)", text):  # torchrun's report: rank, then exitcode
            ranks.setdefault(task, []).append(int(r[1]))
        elif c := re.match(r"\s+exitcode\s*: (-?\d+)", text):
            codes.setdefault(task, []).append(int(c[1]))
    failed = {t: list(zip(ranks.get(t, [None] * len(c)), c)) for t, c in codes.items()}
    return failed, errors, sruns


def diagnose(lines: list, nodes: list, down: list) -> dict:
    """The failed node of a launch on `nodes` (srun's task i ran on nodes[i]), from the launch's log
    lines, in this order:
    1. one Slurm marks down;
    2. a rank that died by itself (a signal, a traceback), not one that lost its peer (exit 3);
    3. srun's first failed task that lost no peer;
    4. the one node that said nothing while the others lost a peer.
    Returns node (None: not named), how, error (the line to quote) and user (some rank's exit 2)."""
    failed, errors, sruns = reports(lines)
    def own(task):  # the task's first error line that is not a lost peer's
        return next((e for e in errors.get(task, []) if not any(s in e for s in LOST)), None)
    def named(node, how, error=""):
        return {"node": node, "how": how, "error": error or how, "user": False}

    for task, ended in failed.items():
        if any(code == 2 for _, code in ended):
            error = own(task) or ""
            return {"node": None, "how": "a user error (exit 2)", "error": error, "user": True}
    for node in down:
        if node in nodes:
            return named(node, "Slurm marks it down, drained or not responding")
    # ranks that ended by themselves: any exit but 3 (lost a peer), or 3 with an error line of their own
    culprits = [(t, rank, code) for t, ended in failed.items() for rank, code in ended
                if code != 3 or own(t)]
    alike = {own(t) for t, _, _ in culprits}
    every_node = len({t for t, _, _ in culprits}) == len(nodes)
    if len(alike) == 1 and None not in alike and every_node:  # a non-finite loss, a full disk
        return named(None, "every node's ranks stopped alike", alike.pop())
    for task, rank, code in culprits:
        who = f"rank {rank}" if rank is not None else "a rank"
        node = nodes[task] if task < len(nodes) else None
        return named(node, f"{who} {how_it_ended(code)}", own(task))
    lost_peer = {nodes[t] for t in set(failed) | set(errors) if t < len(nodes)}
    for node, line in sruns:
        if node in nodes and node not in lost_peer:
            return named(node, line.split(": ", 3)[-1], line)
    silent = [n for n in nodes if n not in lost_peer]
    if lost_peer and len(silent) == 1:
        return named(silent[0], "it stopped answering (the other nodes' ranks lost it)")
    last = next((e for es in reversed(list(errors.values())) for e in reversed(es)), "")
    return named(None, "no node could be named", last or (sruns[-1][1] if sruns else ""))


def launch_lines(log: str, offset: int) -> list:
    """The job log's lines from byte `offset` on: what srun, torchrun and the ranks printed since
    the launch."""
    with open(log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace").splitlines()


def failed(path: str, a) -> str:
    record = load(path)
    lines = launch_lines(a.log, a.offset)
    dump = dump_folder(record, lines)
    nodes, spares, down = a.nodes.split(), a.spares.split(), a.down.split()
    found = diagnose(lines, nodes, down)
    if found["user"]:
        say(f"not restarted: {found['how']} fails the same way again: {found['error']}")
        return "stop 2"

    newest = newest_checkpoint(dump)
    metrics = os.path.join(dump, "metrics.jsonl")
    trained = [step for step, _ in trained_records(metrics, a.since)]
    # steps this launch trained that the next one trains again
    again = max(0, max(trained, default=newest) - newest)
    if record["failures"] and newest <= record["failures"][-1]["resumed"]:
        record["stalled"] += 1  # the last restart got no checkpoint further: a crash loop, if it goes on
    failure = {"time": time.time(), "node": found["node"], "how": found["how"],
               "error": found["error"], "resumed": newest, "again": again}
    record["failures"].append(failure)
    n = len(record["failures"])
    if n > a.max_restarts or record["stalled"] > a.max_stalled:
        why = f"past MAX_RESTARTS={a.max_restarts}"
        if n <= a.max_restarts:
            why = (f"restarts without a newer checkpoint: {record['stalled']}, "
                   f"MAX_STALLED_RESTARTS={a.max_stalled}")
        save(record, path)
        _, kept, all_trained = kept_time(trained_records(metrics, record["first_start"]))
        left_out = " ".join(record["left_out"]) or "none"
        say(f"giving up after {n} failures ({why}): nodes left out: {left_out}; "
            f"steps trained twice: {all_trained - kept}; newest checkpoint step-{newest}; "
            f"last error: {found['error'] or found['how']}")
        end(path, lines)
        return "stop 1"

    node = found["node"]
    if node and spares:
        action, replacement = f"spare {node} {spares[0]}", f"spare {spares[0]} in its place"
        record["left_out"].append(node)
    elif spares:
        action, replacement = "relaunch", "relaunch on the same nodes"
    elif node:
        action, replacement = f"requeue {node}", f"requeue without {node}"
        record["left_out"].append(node)
    else:
        action, replacement = "requeue", "requeue as is"
    record["restarts"] = n
    save(record, path)
    failed_node = f"{node} failed" if node else "a launch failed"
    say(f"restart {n} of {a.max_restarts} (MAX_RESTARTS): {failed_node}: {found['how']}; "
        f"{replacement}; resuming from step-{newest}; steps to train again: {again}")
    return action


# -------------------------------------------------------------------------------------------------
# end: the goodput line
# -------------------------------------------------------------------------------------------------

def kept_time(records: list) -> tuple:
    """(seconds, steps kept, steps trained) from (step, time) records in file order. A record whose
    step is not above the previous one starts a launch that resumed below it: the steps it trains
    again replace the old ones. A record's time covers the steps since the previous record; a
    launch's first step (its start-up inside) is counted at the launch's median step time."""
    kept, trained, launch = {}, 0, []
    for step, t in records + [(None, None)]:
        # the launch before this record has ended
        if launch and (step is None or step <= launch[-1][0]):
            per_step = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(launch, launch[1:])]
            median = statistics.median(per_step) if per_step else 0.0
            resumed = max((s for s in kept if s < launch[0][0]), default=0)
            kept = {s: v for s, v in kept.items() if s <= resumed}
            prev = (resumed, None)
            for s, t1 in launch:
                seconds = median if prev[1] is None else (t1 - prev[1]) / (s - prev[0])
                kept.update({k: seconds for k in range(prev[0] + 1, s + 1)})
                trained += s - prev[0]
                prev = (s, t1)
            launch = []
        if step is not None:
            launch.append((step, t))
    return sum(kept.values()), len(kept), trained


def end(path: str, lines: list):
    record = load(path)
    metrics = os.path.join(dump_folder(record, lines), "metrics.jsonl")
    save(record, path)
    now = time.time()
    seconds, steps, trained = kept_time(trained_records(metrics, record["first_start"]))
    wall = now - record["first_start"]
    goodput = seconds / wall if wall > 0 else 0.0
    failures, restarts = len(record["failures"]), record["restarts"]
    requeues = record["starts"] - 1  # for the time limit too
    say(f"goodput {100 * goodput:.1f}%: {seconds:.1f} s of the {wall:.1f} s since the job's first "
        f"start trained the {steps} steps kept; failures: {failures}, restarts: {restarts}, "
        f"requeues: {requeues}, steps trained twice: {trained - steps}")
    if os.path.exists(metrics):
        summary = {"step": steps, "goodput": goodput, "goodput_seconds": seconds, "wall_seconds": wall,
                   "failures": failures, "restarts": restarts, "requeues": requeues,
                   "steps_trained_twice": trained - steps, "job": record["job"], "time": now}
        with open(metrics, "a") as f:
            f.write(json.dumps(summary) + "\n")


def main(argv):
    raw = argparse.RawDescriptionHelpFormatter  # the docstring's commands, as written
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("start", "failed", "end"):
        c = sub.add_parser(name)
        c.add_argument("record", help="the job's record (a JSON file)")
        c.add_argument("--job", default="")
        c.add_argument("--log", default="/dev/null",
                       help="the job's log, where srun's and the ranks' lines land")
        c.add_argument("--offset", type=int, default=0,
                       help="where in the log the last launch began (bytes)")
    f = sub.choices["failed"]
    f.add_argument("--since", type=float, default=0.0, help="when the launch began (unix s)")
    f.add_argument("--nodes", required=True, help="the launch's nodes, srun's task 0 first")
    f.add_argument("--spares", default="")
    f.add_argument("--down", default="", help="nodes Slurm marks down, drained or not responding")
    f.add_argument("--max_restarts", type=int, default=3)
    f.add_argument("--max_stalled", type=int, default=2)
    a = p.parse_args(argv)
    if a.command == "start":
        start(a.record, a.job)
    elif a.command == "failed":
        print(failed(a.record, a))
    else:
        end(a.record, launch_lines(a.log, a.offset))


if __name__ == "__main__":
    main(sys.argv[1:])
