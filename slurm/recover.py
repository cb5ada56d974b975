"""slurm/multinode.sbatch's bookkeeping: what a failed launch cost, what the script does next, and
the job's goodput.

The script calls it; a person reads its lines in the job's log. The job's record (its starts and
launches with their times, its failures, the nodes left out) is a JSON file next to the log, which
outlives the job's requeues. It imports no torch: it runs between a failure and the next launch,
where every second counts.

    python slurm/recover.py start RECORD --job JOBID --nodes 2  # at every start; see start()
    python slurm/recover.py ended RECORD --log LOG --offset N --since T --code RC --ranks R
    python slurm/recover.py failed RECORD --log LOG --offset N --since T \
        --nodes "n1 n2" --spares "n3" --down "" --excluded "n4" --partition "n1 n2 n3 n4" \
        --nnodes 3 --min_nodes 1 --nproc_per_node 8
    python slurm/recover.py requeue RECORD --excluded "n4" --partition "n1 n2 n3 n4" --nnodes 2 \
        --min_nodes 1 --nproc_per_node 8 --spares 0
    python slurm/recover.py end RECORD                   # the goodput line, also into metrics.jsonl

`ended` records a launch, after each one. `failed` reads the log from byte N (where the launch
began), names the failed node and prints on stdout what to do: `spare NODE SPARE` (relaunch with
SPARE in place of NODE), `relaunch` (same nodes), `shrink NODES [SPARES]` (relaunch on the
comma-separated NODES, the other healthy ones spares: no spare was left, and a requeue would leave
the partition too few nodes), `requeue [NODE]`, `stop CODE`. `requeue` prints how many nodes the
requeued job asks for and the nodes it must exclude, comma-separated: those Slurm excludes already
and every node the record left out; when that leaves the partition too few nodes, fewer (as a
shrink), or where none will do, it stops the job instead, with one line (exit 1).
"""

import argparse
import json
import os
import re
import signal
import sys
import time
import tomllib

# the lines of a rank that lost its peer (pretrain/distributed.py's lost_rank)
LOST = ("lost its connection to another rank", "for a rank that never joined it")
# NCCL's watchdog's line before it aborts its process (SIGABRT), where lost_rank never sees the error:
# a collective that timed out waiting for another rank (torch's ProcessGroupNCCL.cpp). Not its other
# lines ("failure detected by watchdog"): those follow a CUDA error of the rank's own GPU too.
WATCHDOG = "Watchdog caught collective operation timeout"


def say(line: str):
    print(f"{time.strftime('%F %T')} multinode.sbatch: {line}", file=sys.stderr, flush=True)


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:  # a person may have edited it (left_out)
        say(f"cannot read the job's record {path}: {e}: fix it, or delete it to start afresh")
        sys.exit(1)


def save(record: dict, path: str):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)  # a job killed mid-write keeps the previous record


# -------------------------------------------------------------------------------------------------
# start and ended: the job's record, its starts and launches
# -------------------------------------------------------------------------------------------------

def start(path: str, job: str, nodes: int = 1) -> str:
    """The job's record at `path`, made at its first start; every start (1 + its requeues) counts,
    with its time. Returns "N LEFT_OUT": the training nodes of the job's first start (`nodes` then;
    MIN_NODES's default is half of it, though a requeue may ask for fewer), and the nodes the job
    left out: none of them trains in it again."""
    old = load(path) if os.path.exists(path) else {}
    record = old
    if old.get("job") != job:  # another job's record: a log name without %j
        record = {"job": job, "first_start": time.time(), "starts": 0, "started": [],
                  "launches": [], "failures": [], "restarts": 0, "left_out": [], "dump_folder": ""}
    record.setdefault("nodes", nodes)
    record["starts"] += 1
    record["started"].append(time.time())
    save(record, path)
    return f"{record['nodes']} {' '.join(record['left_out'])}".strip()


def ended(path: str, a):
    """A launch's start and end, its exit status, and the checkpoint step it resumed from
    (train.py's `resumed from ... at step N` line; none: it started afresh, at step 0)."""
    record = load(path)
    lines = launch_lines(a.log, a.offset)
    dump_folder(record, lines)
    found = (re.search(r"resumed from .* at step (\d+)$", line) for line in lines)
    resumed = next((int(m[1]) for m in found if m), 0)
    launch = {"start": a.since, "end": time.time(), "code": a.code, "resumed": resumed,
              "ranks": a.ranks}
    for line in lines:  # a clean end's summary: the seconds its saves took, as train.py timed them
        if m := re.search(r"done: step .* saves ([\d.]+)s$", line):
            launch["saves"] = float(m[1])
    record["launches"].append(launch)
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

def run_config(dump: str) -> dict:
    """The run's config as train.py resolved it (config.toml in its dump folder; {}: none readable)."""
    try:
        with open(os.path.join(dump, "config.toml"), "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def newest_checkpoint(dump: str) -> int:
    """The newest step-N with DCP's .metadata, the mark of a complete save (train.py's resume checks
    more)."""
    folder = os.path.join(dump, run_config(dump).get("checkpoint", {}).get("folder", "checkpoint"))
    names = os.listdir(folder) if dump and os.path.isdir(folder) else []
    steps = [int(m[1]) for d in names if (m := re.fullmatch(r"step-(\d+)", d))]
    complete = [s for s in steps if os.path.isfile(os.path.join(folder, f"step-{s}", ".metadata"))]
    return max(complete, default=0)


def metrics_records(metrics: str) -> list:
    """metrics.jsonl's records in file order; a line half-written by a killed rank is skipped."""
    if not os.path.exists(metrics):
        return []
    records = []
    with open(metrics) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def trained_records(metrics: str, since: float) -> list:
    """Training records (step, time) that metrics.jsonl got at or after `since`, in file order."""
    records = [r for r in metrics_records(metrics) if "loss" in r]
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
    `error:` lines, srun's own `error: NODE: task N: ...` lines (node, line), in log order, and the
    (task, rank) of each rank whose collective NCCL's watchdog timed out."""
    ranks, codes, errors, sruns, watchdog = {}, {}, {}, [], set()
    for line in lines:
        if m := re.match(r"srun: error: (\S+): tasks? [\d\-,]+: ", line):
            sruns.append((m[1], line.strip()))
        if not (m := re.match(r"(\d+): (.*)", line)):  # srun --label: the task's index
            continue
        task, text = int(m[1]), m[2]
        if WATCHDOG in text and (w := re.search(r"\[rank(\d+)\]|Rank (\d+)\]", text)):
            watchdog.add((task, int(w[1] or w[2])))
        if e := re.match(r"error: (.*)", text):
            errors.setdefault(task, []).append(e[1])
        elif r := re.match(r"\s+rank\s*: (\d+)", text):  # torchrun's report: rank, then exitcode
            ranks.setdefault(task, []).append(int(r[1]))
        elif c := re.match(r"\s+exitcode\s*: (-?\d+)", text):
            codes.setdefault(task, []).append(int(c[1]))
    failed = {t: list(zip(ranks.get(t, [None] * len(c)), c)) for t, c in codes.items()}
    return failed, errors, sruns, watchdog


def diagnose(lines: list, nodes: list, down: list) -> dict:
    """The failed node of a launch on `nodes` (srun's task i ran on nodes[i]), from the launch's log
    lines, in this order:
    1. one Slurm marks down;
    2. one a fault's line names (`error: node NAME: ...`, exit 4: pretrain/faults.py);
    3. a rank that died by itself (a signal, a traceback), not one that lost its peer (exit 3, or
       NCCL's watchdog's SIGABRT after a collective timed out waiting for a peer);
    4. srun's first failed task that lost no peer;
    5. the one node that said nothing while the others lost a peer.
    Returns node (None: not named), how, error (the line to quote) and user (some rank's exit 2)."""
    failed, errors, sruns, watchdog = reports(lines)
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
    for said in errors.values():  # every rank prints the fault's line: the node it names
        for line in said:
            if (m := re.match(r"node (\S+): ", line)) and m[1] in nodes:
                return named(m[1], "a fault of that node (exit 4)", line)
    # ranks that ended by themselves: any exit but 3 (lost a peer) or the watchdog's SIGABRT (-6), or
    # either with an error line of their own
    culprits = [(t, rank, code) for t, ended in failed.items() for rank, code in ended
                if (code != 3 and not (code == -6 and (t, rank) in watchdog)) or own(t)]
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
    # the last restart got no checkpoint further: a crash loop, if it goes on
    stalled = bool(record["failures"]) and newest <= record["failures"][-1]["resumed"]
    launched = sum(run["end"] - run["start"] for run in record["launches"])  # the job's, so far
    failure = {"time": time.time(), "node": found["node"], "how": found["how"],
               "error": found["error"], "resumed": newest, "again": again, "stalled": stalled,
               "launched": launched}
    record["failures"].append(failure)
    n = len(record["failures"])
    stalls = recent_stalls(record["failures"], a.stall_window)
    if n > a.max_restarts or stalls > a.max_stalled:
        why = f"past MAX_RESTARTS={a.max_restarts}"
        if n <= a.max_restarts:
            why = (f"restarts without a newer checkpoint in the last {a.stall_window / 3600:g} h "
                   f"of launches: {stalls}, MAX_STALLED_RESTARTS={a.max_stalled}")
        save(record, path)
        twice = account(record, time.time())["steps_again"]
        left_out = " ".join(record["left_out"]) or "none"
        say(f"giving up after {n} failures ({why}): nodes left out: {left_out}; "
            f"steps trained twice: {twice}; newest checkpoint step-{newest}; "
            f"last error: {found['error'] or found['how']}")
        end(path)
        return "stop 1"

    node = found["node"]
    if node and spares:
        action, replacement = f"spare {node} {spares[0]}", f"spare {spares[0]} in its place"
        record["left_out"].append(node)
    elif spares:
        action, replacement = "relaunch", "relaunch on the same nodes"
    elif node:
        record["left_out"].append(node)
        action, replacement = f"requeue {node}", f"requeue without {node}"
        room = len(nodes_left(record, a.excluded, a.partition))  # for a requeued job
        if a.partition and room < a.nnodes:  # a requeue would stop: go on with the nodes left
            left = [n for n in nodes if n != node and n not in down]
            k, layout = shrink_to(run_config(dump), len(left), a.min_nodes, a.nproc_per_node)
            where = f"no spare, and the partition has {room} node(s) for a job of {a.nnodes}"
            replacement = f"{where}, not shrinking ({layout}); {replacement}"
            if k:  # the first k train; the others left become spares
                action = f"shrink {','.join(left[:k])} {','.join(left[k:])}".strip()
                replacement = f"{where}: relaunching on {layout}"
    else:
        action, replacement = "requeue", "requeue as is"
    record["restarts"] = n
    save(record, path)
    failed_node = f"{node} failed" if node else "a launch failed"
    say(f"restart {n} of {a.max_restarts} (MAX_RESTARTS): {failed_node}: {found['how']}; "
        f"{replacement}; resuming from step-{newest}; steps to train again: {again}")
    return action


def recent_stalls(failures: list, window: float) -> int:
    """Restarts that got no newer checkpoint within the job's last `window` seconds of launches
    (their time training or starting, not queued): a crash loop repeats within it, where two
    stalls weeks apart are bad luck twice."""
    now = failures[-1].get("launched", 0.0)
    return sum(1 for f in failures if f.get("stalled") and now - f.get("launched", 0.0) < window)


def shrink_to(config: dict, nodes: int, min_nodes: int, nproc: int) -> tuple:
    """(K, what) for a relaunch or a requeue on the nodes a job has left: K the most nodes, from
    `nodes` down to `min_nodes`, that the run's fixed global batch and data streams divide into
    (train.validate's rules), and a line on the layout and its gradient accumulation; (0, why not)
    where none does."""
    if not config:
        return 0, "the run's config.toml cannot be read"
    training = config.get("training", {})
    p = config.get("parallelism", {})
    gbs = training.get("global_batch_size", -1)
    streams = config.get("data", {}).get("num_streams", 0)
    local = training.get("local_batch_size", 1)
    tp = p.get("tensor_parallel_degree", 1)
    rep = p.get("data_parallel_replicate_degree", 1)
    if gbs == -1 or streams == 0:  # they follow the GPU count, and a resume would be refused
        return 0, (f"training.global_batch_size = {gbs} and data.num_streams = {streams} follow the "
                   "GPU count: fix both in the config to let a job shrink")
    if p.get("data_parallel_shard_degree", -1) != -1:
        return 0, "parallelism.data_parallel_shard_degree is fixed: set -1 to let a job shrink"
    if nodes < min_nodes:
        return 0, f"{nodes} node(s) left, below MIN_NODES={min_nodes}"
    for k in range(nodes, max(min_nodes, 1) - 1, -1):
        world = k * nproc
        dp = world // tp
        if world % (tp * rep) == 0 and streams % dp == 0 and gbs % (local * dp) == 0:
            accumulation = gbs // (local * dp)
            return k, (f"{k} of the {nodes} node(s) left: world {world} = dp {dp} x "
                       f"tp {tp}, grad accumulation {accumulation} (global batch {gbs}, "
                       f"{streams} data streams)")
    return 0, (f"no node count from {nodes} down to MIN_NODES={min_nodes} divides global batch "
               f"{gbs} and {streams} data streams at {nproc} rank(s) per node, tp {tp}")


# -------------------------------------------------------------------------------------------------
# requeue: without every node the job left out
# -------------------------------------------------------------------------------------------------

def nodes_left(record: dict, excluded: str, partition: str) -> list:
    """The partition's nodes a requeued job could land on: not those Slurm excludes already, nor any
    the job left out ([]: sinfo said nothing)."""
    exclude = set(excluded.split()) | set(record["left_out"])
    return [node for node in partition.split() if node not in exclude]


def requeue(path: str, a) -> str:
    """"N EXCLUDE": the nodes the requeued job asks for, and those it excludes: the ones Slurm
    excludes already and every node the job left out (a person brings one back by removing it from
    the record's left_out). Where the partition has too few nodes left for the job (one that shrank
    after a failure, at its time limit), N is fewer: its spares and the most training nodes that
    shrink_to allows, down to MIN_NODES. Stops (exit 1) with one line where none does."""
    record = load(path)
    exclude = sorted(set(a.excluded.split()) | set(record["left_out"]))
    left = nodes_left(record, a.excluded, a.partition)
    nodes = a.nnodes
    if a.partition and len(left) < a.nnodes:  # no partition: sinfo said nothing, no count to check
        left_out = " ".join(record["left_out"]) or "none"
        where = (f"without {' '.join(exclude)} (failed and left out: {left_out}), the partition "
                 f"has {len(left)} node(s) for a job of {a.nnodes}")
        k, layout = shrink_to(run_config(record["dump_folder"]), len(left) - a.spares,
                              a.min_nodes, a.nproc_per_node)
        if not k:
            say(f"not requeued: {where}, and not shrinking ({layout}): remove a repaired node from "
                f"left_out in {path} and from the job's ExcNodeList (scontrol update "
                f"job={record['job']} ExcNodeList=...), or resubmit with fewer nodes")
            end(path)
            sys.exit(1)
        nodes = k + a.spares
        say(f"{where}: requeueing on {layout}" + (f", and {a.spares} spare(s)" if a.spares else ""))
    return f"{nodes} {','.join(exclude)}".strip()


# -------------------------------------------------------------------------------------------------
# end: the goodput line
# -------------------------------------------------------------------------------------------------

def launch_records(records: list, launches: list) -> list:
    """Per launch: its training records with rounds, the seconds of the validation and eval rounds
    logged since its previous training record, in file order; and tail_rounds, those logged after
    its last one. A record belongs to the launch whose start and end hold its time; one of no
    launch (an earlier job's, in the same dump folder) is left out."""
    per = [{"records": [], "tail_rounds": 0.0} for _ in launches]
    current, pending = None, 0.0
    for r in records:
        # a round: no step's time (nor a skip's record from before they carried theirs)
        if "time" not in r or ("loss" not in r and "rewound_to" not in r and "skipped" not in r):
            pending += r.get("validation_seconds", 0.0) + r.get("eval_seconds", 0.0)
            continue
        inside = (j for j, run in enumerate(launches) if run["start"] <= r["time"] <= run["end"])
        j = next(inside, None)
        if j != current and current is not None:  # the previous launch's rounds after its last step
            per[current]["tail_rounds"] += pending
            pending = 0.0
        current = j
        if j is not None:
            per[j]["records"].append((r, 0.0 if "skipped" in r else pending))
        if "skipped" not in r:  # a skip's record ends no span of steps: its rounds go to the next
            pending = 0.0
    if current is not None:
        per[current]["tail_rounds"] += pending
    return per


def timed_seconds(r: dict, steps: int, ranks: int) -> float | None:
    """The seconds a training record's last `steps` took as train.py timed them (its tps: tokens per
    second per rank, with the save, validation and eval rounds timed apart); None: it cannot say."""
    if not (ranks and r.get("tps") and r.get("tokens_seen") and r.get("step")):
        return None
    tokens = steps * r["tokens_seen"] / r["step"]  # a step trains the global batch, which is fixed
    return tokens / (r["tps"] * ranks)


def one_launch(run: dict, got: dict, next_resumed: int | None) -> tuple:
    """({step: seconds} of the steps a launch trained, {cause: seconds} of its time lost, the steps a
    rewind trained again). The time from one training record to the next, less the rounds logged
    between them, is its steps' time as train.py timed them (a skipped step's is lost: its update
    was thrown away); what is left is start-up before the first record, a save after."""
    lost = {"start_up": 0.0, "trained_again": 0.0, "skipped_steps": 0.0, "saving": 0.0,
            "failures": 0.0, "other": 0.0}
    seconds = {}
    skipped = set()  # the steps a loss spike skipped (pretrain/spikes.py's records)
    untimed = 0.0  # after the first record, what train.py did not time as steps: saves, an exit
    rewound = 0
    prev_step, prev_time = run["resumed"], run["start"]

    def spread(steps: range, each: float):  # a skipped step's seconds are lost: its update was not kept
        lost["skipped_steps"] += each * len(skipped.intersection(steps))
        seconds.update({k: each for k in steps if k not in skipped})

    for r, rounds in got["records"]:
        if "rewound_to" in r:  # repeated loss spikes (pretrain/spikes.py): those steps train again
            took = max(0.0, r["time"] - prev_time - rounds)
            lost["other"] += rounds
            if prev_time == run["start"]:  # no record yet to tell its start-up from its steps
                lost["start_up"] += took
            elif r["step"] > prev_step:  # the steps since the last record, skipped or kept till now
                spread(range(prev_step + 1, r["step"] + 1), took / (r["step"] - prev_step))
            else:
                untimed += took  # the reload
            again = drop(seconds, r["rewound_to"])
            lost["trained_again"] += sum(again)
            rewound += len(again)
            prev_step, prev_time = r["rewound_to"], r["time"]
            skipped = {k for k in skipped if k <= prev_step}  # those above train again
            continue
        if "skipped" in r:
            skipped.add(r["step"])
            continue
        n = r["step"] - prev_step
        if n <= 0:  # a step at or below the checkpoint it resumed from: a record of another run
            continue
        took = max(0.0, r["time"] - prev_time - rounds)
        timed = timed_seconds(r, n, run.get("ranks", 0))
        trained = took if timed is None else min(took, timed)
        if prev_time == run["start"]:
            lost["start_up"] += took - trained
        else:
            untimed += took - trained
        lost["other"] += rounds
        spread(range(prev_step + 1, r["step"] + 1), trained / n)
        prev_step, prev_time = r["step"], r["time"]
    # After the last record: a clean end's unlogged steps up to the checkpoint the next launch
    # resumed from (a stop on the time-limit warning) at the launch's pace, then its save and
    # exit; a failure's unlogged steps and the time until every rank had stopped.
    tail = max(0.0, run["end"] - prev_time - got["tail_rounds"])
    lost["other"] += got["tail_rounds"]
    if run["code"] != 0:
        lost["failures"] += tail
    else:
        pace = sum(seconds.values()) / len(seconds) if seconds else 0.0
        n = max(0, (next_resumed or 0) - prev_step)
        trained = min(tail, n * pace)
        if n:
            spread(range(prev_step + 1, prev_step + n + 1), trained / n)
        untimed += tail - trained
    # train.py's `done:` line says how long a clean end's saves took; the rest is its exit (and
    # torchrun's). A failed launch's time between records is its saves.
    saving = min(untimed, run.get("saves", untimed))
    lost["saving"] += saving
    lost["other"] += untimed - saving
    return seconds, lost, rewound


def between_launches(record: dict, now: float) -> dict:
    """The job's time outside its launches, by cause: from a launch's end to the job's next start
    (a requeue: the queue, the script's exit and start), from a start to its launch (start-up), and
    from a failed launch's end to the next launch in the same allocation (failures)."""
    cause = {("end", "start"): "queued", ("start", "start"): "queued",
             ("start", "launch"): "start_up", ("end", "launch"): "failures"}
    events = [(t, "start") for t in record.get("started", [])]
    events += [(run["start"], "launch") for run in record["launches"]]
    events += [(run["end"], "end") for run in record["launches"]]
    lost = dict.fromkeys(("queued", "start_up", "failures", "other"), 0.0)
    order = {"start": 0, "launch": 1, "end": 2}  # at the same time: a start comes first
    events.sort(key=lambda event: (event[0], order[event[1]]))
    for (t0, kind0), (t1, kind1) in zip(events, events[1:] + [(now, "now")]):
        if (kind0, kind1) != ("launch", "end"):  # a launch's own time: one_launch
            lost[cause.get((kind0, kind1), "other")] += t1 - t0
    return lost


def account(record: dict, now: float) -> dict:
    """The job's wall time since its first start split into the training of the steps it kept (each
    step's time in the launch that trained it last) and the time lost to each cause: queued,
    start-up (to the first step), steps trained again, steps skipped, saving, failures, other
    (validation and eval rounds, the bookkeeping)."""
    dump = record["dump_folder"]
    records = metrics_records(os.path.join(dump, "metrics.jsonl")) if dump else []
    launches = record["launches"]
    lost = {"queued": 0.0, "start_up": 0.0, "trained_again": 0.0, "skipped_steps": 0.0, "saving": 0.0,
            "failures": 0.0, "other": 0.0}
    for cause, seconds in between_launches(record, now).items():
        lost[cause] += seconds
    kept = {}  # step: its seconds in the launch that trained it last
    steps_again = 0
    for j, (run, got) in enumerate(zip(launches, launch_records(records, launches))):
        next_resumed = launches[j + 1]["resumed"] if j + 1 < len(launches) else None
        seconds, launch_lost, rewound = one_launch(run, got, next_resumed)
        for cause, lost_seconds in launch_lost.items():
            lost[cause] += lost_seconds
        steps_again += rewound
        again = drop(kept, run["resumed"])  # the steps this launch trains again
        lost["trained_again"] += sum(again)
        steps_again += len(again)
        kept.update(seconds)
    return {"kept": sum(kept.values()), "steps_kept": len(kept), "steps_again": steps_again,
            "lost": lost}


def drop(kept: dict, above: int) -> list:
    """Takes the steps above `above` out of `kept`: their seconds."""
    return [kept.pop(step) for step in sorted(kept) if step > above]


def end(path: str):
    record = load(path)
    now = time.time()
    got = account(record, now)
    wall = now - record["first_start"]
    goodput = got["kept"] / wall if wall > 0 else 0.0
    failures, restarts = len(record["failures"]), record["restarts"]
    requeues = record["starts"] - 1  # for the time limit too
    lost = ", ".join(f"{cause.replace('_', ' ')} {s:.1f} s" for cause, s in got["lost"].items())
    say(f"goodput {100 * goodput:.1f}%: {got['kept']:.1f} s of the {wall:.1f} s since the job's "
        f"first start trained the {got['steps_kept']} steps kept; failures: {failures}, "
        f"restarts: {restarts}, requeues: {requeues}, steps trained twice: {got['steps_again']}; "
        f"time lost: {lost}")
    metrics = os.path.join(record["dump_folder"], "metrics.jsonl")
    if record["dump_folder"] and os.path.exists(metrics):
        # "record" names the kind, and no "step": a reader takes a record with a step for a step's
        summary = {"record": "goodput", "goodput": goodput, "steps_kept": got["steps_kept"],
                   "goodput_seconds": got["kept"], "wall_seconds": wall,
                   "lost_seconds": got["lost"], "failures": failures, "restarts": restarts,
                   "requeues": requeues, "steps_trained_twice": got["steps_again"],
                   "job": record["job"], "time": now}
        with open(metrics, "a") as f:
            f.write(json.dumps(summary) + "\n")


def main(argv):
    raw = argparse.RawDescriptionHelpFormatter  # the docstring's commands, as written
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("start", "ended", "failed", "requeue", "end"):
        c = sub.add_parser(name)
        c.add_argument("record", help="the job's record (a JSON file)")
        c.add_argument("--job", default="")
        c.add_argument("--log", default="/dev/null",
                       help="the job's log, where srun's and the ranks' lines land")
        c.add_argument("--offset", type=int, default=0,
                       help="where in the log the last launch began (bytes)")
    for name in ("ended", "failed"):
        sub.choices[name].add_argument("--since", type=float, default=0.0,
                                       help="when the launch began (unix s)")
    sub.choices["start"].add_argument("--nodes", type=int, default=1,
                                      help="the training nodes of this start")
    e = sub.choices["ended"]
    e.add_argument("--code", type=int, default=0, help="srun's exit status")
    e.add_argument("--ranks", type=int, default=0, help="the launch's ranks (0: not known)")
    f = sub.choices["failed"]
    f.add_argument("--nodes", required=True, help="the launch's nodes, srun's task 0 first")
    f.add_argument("--spares", default="")
    f.add_argument("--down", default="", help="nodes Slurm marks down, drained or not responding")
    f.add_argument("--max_restarts", type=int, default=3)
    f.add_argument("--max_stalled", type=int, default=2)
    f.add_argument("--stall_window", type=float, default=3600.0,
                   help="seconds of the job's launches within which restarts that got no newer "
                        "checkpoint add up (MAX_STALLED_RESTARTS)")
    for name in ("failed", "requeue"):  # where a requeued job could land, and on how many nodes
        r = sub.choices[name]
        r.add_argument("--excluded", default="", help="the nodes the job excludes already")
        r.add_argument("--partition", default="", help="the partition's nodes (none: no count)")
        r.add_argument("--nnodes", type=int, default=1, help="the nodes the job asks for")
        r.add_argument("--min_nodes", type=int, default=1,
                       help="the fewest nodes a job that lost one goes on with (MIN_NODES)")
        r.add_argument("--nproc_per_node", type=int, default=1, help="ranks per node")
    sub.choices["requeue"].add_argument("--spares", type=int, default=0,
                                        help="the job's spare nodes (SPARE_NODES)")
    a = p.parse_args(argv)
    if a.command == "start":
        print(start(a.record, a.job, a.nodes))
    elif a.command == "ended":
        ended(a.record, a)
    elif a.command == "failed":
        print(failed(a.record, a))
    elif a.command == "requeue":
        print(requeue(a.record, a))
    else:
        end(a.record)


if __name__ == "__main__":
    main(sys.argv[1:])
