"""slurm/multinode.sbatch on a real Slurm: a 2-node CPU job, and a job that gets the time-limit warning, checkpoints
on it, requeues itself and resumes with bitwise the same losses as an uninterrupted run;
slurm/preflight.sbatch (preflight.py check through multinode.sbatch) on the same two nodes; and recovery: a rank
killed with a spare node, without one, at every launch (a crash loop), a user error, and torchrun alone.

    bash .ci/install_slurm.sh          # munge slurmctld slurmd slurm-client shellcheck (Debian, as root)
    python -m pytest tests/test_slurm.py -v

The module starts its own munged, slurmctld and three slurmd (nodes n1 n2 n3 on this one machine), all on
127.0.0.1 with state under a pytest tmp folder, and stops them by PID at the end. The slurmds run in a private
mount namespace whose /etc/hosts maps the nodes to 127.0.0.1, so the jobs can resolve their node names.
Without root or the packages the cluster tests skip, saying why. All the jobs run side by side, submitted by the
suite's first test, while the other tests run (conftest.py: starts_early).
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "slurm", "multinode.sbatch")
PREFLIGHT = os.path.join(ROOT, "slurm", "preflight.sbatch")
NODES = ("n1", "n2", "n3")  # two for a 2-node job, one more: a spare, or where a requeue goes
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "unshare",
           "mount")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}

# Every job trains the same short run, the small shape (conftest.SMALL, 2 sequences per rank: 0.1-0.3 s a step on 2
# cores beside the other jobs) with a checkpoint every 5 steps. The time-limit job and the recovery jobs are compared
# with the uninterrupted one, "reference", step by step.
STEPS = 30
TRAIN_ARGS = ["--training.steps", str(STEPS), *SMALL, "--training.local_batch_size", "2", "--metrics.log_freq", "1",
              "--checkpoint.enable", "--checkpoint.interval", "5", "--validation.enable", "false"]


# -------------------------------------------------------------------------------------------------------
# A throwaway 2-node cluster
# -------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, n=40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return f"(no {path})"


class Cluster:
    def __init__(self, tmp):
        self.tmp = str(tmp)
        self.conf = os.path.join(self.tmp, "slurm.conf")
        self.procs = []  # (name, Popen) in start order
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        bin_dir = os.path.join(self.tmp, "bin")  # `torchrun` for the jobs = this interpreter's torch
        os.makedirs(bin_dir)
        # KILL_*: a job whose task KILL_TASK loses a rank; FAULT_*: whose task FAULT_TASK's Hub reads time out at
        # its first launch (tests/fault_train.py in place of train.py)
        with open(os.path.join(bin_dir, "torchrun"), "w") as f:
            f.write(f"""#!/bin/sh
if [ -n "${{KILL_METRICS:-}}" ] && [ "$SLURM_PROCID" = "${{KILL_TASK:-1}}" ]; then
    "{sys.executable}" "{ROOT}/tests/kill_rank.py" $$ "$KILL_METRICS" "${{KILL_AFTER:-3}}" "${{KILL_ONCE:-}}" &
fi
if [ -n "${{FAULT_ONCE:-}}" ] && [ "$SLURM_PROCID" = "${{FAULT_TASK:-1}}" ] && [ ! -e "$FAULT_ONCE" ]; then
    touch "$FAULT_ONCE"
    for a in "$@"; do shift; [ "$a" = train.py ] && a="{ROOT}/tests/fault_train.py"; set -- "$@" "$a"; done
fi
exec "{sys.executable}" -m torch.distributed.run "$@"
""")
        os.chmod(os.path.join(bin_dir, "torchrun"), 0o755)
        env.update(SLURM_CONF=self.conf, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{env.get('PATH', '')}",
                   CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo", LOGLEVEL="INFO", PYTHONUNBUFFERED="1")
        self.env = env

    def write_config(self):
        t = self.tmp
        for d in ("state", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(t, d), exist_ok=True)
        cpus = max(os.cpu_count() or 1, 8)  # every job at once (config_overrides: more than the machine has)
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} State=UNKNOWN"
                          for n in NODES)
        with open(self.conf, "w") as f:
            f.write(f"""\
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job is held (default 120 s; 5 s here)
AuthInfo=socket={t}/munge.sock,cred_expire=5
# only 127.0.0.1, never every interface
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool/%n
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd-%n.pid
SlurmctldLogFile={t}/slurmctld.log
SlurmdLogFile={t}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=5,bf_interval=5
# a job past its time limit is killed at once, SIGKILL 5 s after SIGTERM
OverTimeLimit=0
KillWait=5
MinJobAge=3600
{nodes}
PartitionName=ci Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        with open("/etc/hosts") as f:
            hosts = f.read()
        with open(os.path.join(t, "hosts"), "w") as f:
            f.write(hosts.rstrip("\n") + f"\n127.0.0.1 {' '.join(NODES)}\n")
        with open(os.path.join(t, "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(os.path.join(t, "munge.key"), 0o400)

    def spawn(self, name, cmd):
        log = open(os.path.join(self.tmp, f"{name}.out"), "w")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((name, proc))

    def start(self):
        t = self.tmp
        self.write_config()
        self.spawn("munged", ["munged", "-F", "--force", f"--socket={t}/munge.sock", f"--key-file={t}/munge.key",
                              f"--pid-file={t}/munged.pid", f"--seed-file={t}/munged.seed",
                              f"--log-file={t}/munged.log"])
        self.wait_for(lambda: os.path.exists(f"{t}/munge.sock"), 10, "munged did not create its socket")
        self.spawn("slurmctld", ["slurmctld", "-D"])
        for node in NODES:  # private mount namespace: /etc/hosts with n1 n2, only for slurmd and its jobs
            self.spawn(f"slurmd-{node}", ["unshare", "--mount", "sh", "-c",
                                          'mount --bind "$1" /etc/hosts && exec slurmd -D -N "$2"', "sh",
                                          f"{t}/hosts", node])
        idle = ["idle", str(len(NODES))]
        self.wait_for(lambda: self.run("sinfo", "-h", "-o", "%T %D", check=False).stdout.split() == idle,
                      30, "the nodes did not come up idle")

    def wait_for(self, ready, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            dead = [n for n, p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{what}: {dead} exited\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout} s\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {n}:\n{tail(os.path.join(self.tmp, f'{n}.out'), 15)}" for n, _ in self.procs)

    def run(self, *cmd, check=True, **kw):
        proc = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, name, env, sbatch_args, train_args, script=SBATCH) -> str:
        out = self.run("sbatch", "--parsable", f"--job-name={name}", "--nodes=2",
                       f"--output={self.tmp}/{name}-%j.out", *sbatch_args, script, *train_args,
                       cwd=ROOT, env={**self.env, **env}).stdout
        return out.strip().split(";")[0]

    def jobs(self) -> dict:
        """{job id: scontrol's fields} of every job, one call (finished ones stay listed: MinJobAge)."""
        out = self.run("scontrol", "show", "job", "-o", check=False).stdout
        infos = (dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines())
        return {info["JobId"]: info for info in infos if "JobId" in info}

    def stop(self):
        """Cancel what still runs, stop the daemons by PID, then any job process they left behind."""
        try:
            if any(n == "slurmctld" and p.poll() is None for n, p in self.procs):
                ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if ids:
                    self.run("scancel", *ids, check=False)
                    deadline = time.time() + 20
                    while time.time() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                        time.sleep(0.5)
            deadline = time.time() + 10  # let finished steps' slurmstepd exit and be reaped by slurmd
            while time.time() < deadline and self.leftovers(daemons=False):
                time.sleep(0.5)
        finally:
            for _, proc in reversed(self.procs):
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            for pid in self.leftovers():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def leftovers(self, daemons=True) -> list:
        """Processes whose environment carries this cluster's SLURM_CONF: slurmstepd and job processes, and
        with daemons=True also the daemons (and slurmctld's slurmscriptd)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if daemons or comm not in ("munged", "slurmctld", "slurmd", "slurmscriptd"):
                found.append(int(pid))
        return found


def why_no_cluster():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (munged, slurmctld and slurmd run as root here)"
    missing = [b for b in DAEMONS if shutil.which(b) is None]
    if missing:
        return f"missing {' '.join(missing)}: run .ci/install_slurm.sh (Debian: munge slurmctld slurmd slurm-client)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="session")  # the jobs run beside the rest of the suite (started_jobs)
def cluster(tmp_path_factory):
    reason = why_no_cluster()
    if reason:
        pytest.skip(f"no Slurm cluster: {reason}")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        try:
            c.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"no Slurm cluster: the scheduler did not start: {e}")
        yield c
    finally:
        c.stop()


# -------------------------------------------------------------------------------------------------------
# Helpers for the jobs
# -------------------------------------------------------------------------------------------------------

def read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def losses(dump) -> list:
    """(step, loss) per metrics.jsonl line, in file order."""
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]  # not validation rounds


def job_env(cluster, **extra):
    return {"CONFIG_FILE": "configs/debug_model.toml", "NPROC_PER_NODE": "1", "PORT": str(free_port()), **extra}


def metrics_steps(dump) -> int:
    """How many steps the run in dump has logged so far."""
    try:
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return sum('"loss"' in line for line in f)
    except OSError:
        return 0


# The jobs, all at once on the three nodes (the script asks for whole nodes; --exclusive=user lets one user's jobs
# share them). The recovery jobs lose a rank after a few steps (tests/kill_rank.py, started by the cluster's torchrun
# on srun's task KILL_TASK).
JOBS = {  # name: (sbatch args, environment); a kill after 8 new steps: step-5 is complete by then
    "reference": (["--nodes=2"], {}),
    "timelimit": (["--nodes=2"], {}),
    "spare": (["--nodes=3"], {"SPARE_NODES": "1", "KILL_AFTER": "8", "KILL_ONCE": "killed"}),
    "no_spare": (["--nodes=2"], {"KILL_AFTER": "8", "KILL_ONCE": "killed"}),
    "crash_loop": (["--nodes=1"], {"KILL_TASK": "0", "KILL_AFTER": "1", "MAX_STALLED_RESTARTS": "0"}),
    "user_error": (["--nodes=1"], {}),
    "fault": (["--nodes=2"], {"FAULT_TASK": "1", "FAULT_ONCE": "fault"}),  # a Hub that times out on one node
    # a spare swap, then the time-limit warning and a minute held in the queue (log_freq 2: watch)
    "swap_requeue": (["--nodes=2"], {"SPARE_NODES": "1", "KILL_TASK": "0", "KILL_AFTER": "4", "KILL_ONCE": "killed"}),
    # no spare, and with n3 excluded no node to requeue onto: it goes on on n1 alone (SHRINK_ARGS: a fixed batch),
    # then the time-limit warning: it requeues itself asking for 1 node
    "shrink": (["--nodes=2", "--exclude=n3"], {"KILL_AFTER": "8", "KILL_ONCE": "killed"}),
}
# The shrink job's global batch is fixed (4: 2 per step from each of debug_model.toml's 2 data streams), with
# micro-batches of 1: 2 a step on 2 nodes, 4 on 1 node, which the old rule refused (1 sequence from 2 streams).
SHRINK_ARGS = ["--training.global_batch_size", "4", "--training.local_batch_size", "1"]
WARN_AT = 8  # the time-limit job gets its warning once it has logged this many steps
SWAP_WARN_AT = 9  # swap_requeue's, once it has this many training records, 4 or 5 of them before the kill
SHRINK_WARN_AT = 13  # shrink's, once it has this many: 8 before the kill, the rest on n1 alone
HOLD = 60  # seconds swap_requeue is held in the queue after its requeue


def watch(cluster, ids: dict, dumps: dict, ended: dict, marks: dict, deadline: float):
    """Until every job of ids ({name: job id}) has ended or the deadline passed: scontrol's fields of each job that
    ended into ended, the time-limit jobs' warnings once they train, and swap_requeue's minute held in the queue
    after its requeue (marks: when it was held and released)."""
    warned = swap_warned = shrink_warned = False
    swap = ids["swap_requeue"]
    while len(ended) < len(ids) and time.time() < deadline:
        if not warned and metrics_steps(dumps["timelimit"]) >= WARN_AT:
            cluster.run("scancel", "--batch", "--signal=USR1", ids["timelimit"])
            warned = True
        killed = os.path.exists(os.path.join(dumps["swap_requeue"], "killed"))  # the spare trains now
        if not swap_warned and killed and metrics_steps(dumps["swap_requeue"]) >= SWAP_WARN_AT:
            cluster.run("scancel", "--batch", "--signal=USR1", swap)
            swap_warned = True
        shrunk = os.path.exists(os.path.join(dumps["shrink"], "killed"))
        if not shrink_warned and shrunk and metrics_steps(dumps["shrink"]) >= SHRINK_WARN_AT:
            cluster.run("scancel", "--batch", "--signal=USR1", ids["shrink"])
            shrink_warned = True
        infos = cluster.jobs()
        if swap_warned and "held" not in marks and infos.get(swap, {}).get("JobState") == "PENDING":
            cluster.run("scontrol", "hold", swap)
            marks["held"] = time.time()
        if "held" in marks and "released" not in marks and time.time() > marks["held"] + HOLD:
            cluster.run("scontrol", "release", swap)
            marks["released"] = time.time()
        for name, job_id in ids.items():
            if infos.get(job_id, {}).get("JobState") in DONE:
                ended.setdefault(name, infos[job_id])
        time.sleep(1)


@pytest.fixture(scope="session")
def started_jobs(cluster, tmp_path_factory):
    """Every job of JOBS, and slurm/preflight.sbatch after five of them (about 15 s; each node declares 8 CPUs,
    so none waits for a node), submitted at once and watched by a thread: (ids, dumps, logs, the ended jobs'
    fields, the thread). The time-limit job gets Slurm's time-limit warning as `#SBATCH --signal=B:USR1@120` has
    Slurm send it (SIGUSR1 to the batch shell), from `scancel --batch --signal=USR1` once it trains: waiting for
    Slurm's own timer would cost minutes (slurmctld checks time limits every 30 s) of training the reference too.
    It checkpoints, requeues itself and resumes."""
    ids, dumps = {}, {}
    for name, (sbatch_args, extra) in JOBS.items():
        dumps[name] = str(tmp_path_factory.mktemp(name))
        env = dict(extra)
        if "KILL_AFTER" in env:
            env["KILL_METRICS"] = os.path.join(dumps[name], "metrics.jsonl")
        if "KILL_ONCE" in env:
            env["KILL_ONCE"] = os.path.join(dumps[name], "killed")  # the kill's time; none after the first
        if "FAULT_ONCE" in env:
            env["FAULT_ONCE"] = os.path.join(dumps[name], "fault")
        args = ["--job.dump_folder", dumps[name], *TRAIN_ARGS]
        if name == "user_error":
            args.append("--training.stepz=5")  # train.py's ConfigError on every rank: exit 2
        if name == "swap_requeue":
            args += ["--metrics.log_freq", "2"]  # the goodput takes steps from checkpoints, not logged steps
        if name == "shrink":
            args += SHRINK_ARGS
        ids[name] = cluster.sbatch(name, job_env(cluster, **env), ["--exclusive=user", *sbatch_args], args)
    # The preflight waits for the jobs that end without a requeue: started beside all nine, its ranks shared each core
    # with many others, and one rank's matmul timing could fall below preflight's FAIL line (docs/slurm.md)
    dumps["preflight"] = str(tmp_path_factory.mktemp("preflight"))
    after = ":".join(ids[name] for name in ("reference", "spare", "crash_loop", "user_error", "fault"))
    ids["preflight"] = cluster.sbatch("preflight", job_env(cluster),
                                      ["--exclusive=user", f"--dependency=afterany:{after}"],
                                      ["--job.dump_folder", dumps["preflight"]], script=PREFLIGHT)
    logs = {name: os.path.join(cluster.tmp, f"{name}-{ids[name]}.out") for name in ids}
    ended, marks = {}, {}
    watcher = threading.Thread(target=watch, args=(cluster, ids, dumps, ended, marks, time.time() + 1800),
                               daemon=True)
    watcher.start()
    return ids, dumps, logs, ended, watcher, marks


@pytest.fixture(scope="session")
def jobs(started_jobs):
    """{name: (job id, scontrol's fields, dump folder, log)} of every job of started_jobs, once all have ended."""
    ids, dumps, logs, ended, watcher, _ = started_jobs
    watcher.join()
    for name in ids.keys() - ended.keys():
        raise AssertionError(f"job {name} not finished: {tail(logs[name], 60)}")
    return {name: (ids[name], ended[name], dumps[name], logs[name]) for name in ids}


@pytest.mark.slow
@pytest.mark.starts_early
def test_the_jobs_start_and_run_beside_the_rest_of_the_suite(started_jobs):
    """Runs first (conftest.py): the jobs take minutes of waiting (start-ups, requeues, Slurm's scheduling
    passes), which the other tests' runs fill; the tests below collect them."""
    ids = started_jobs[0]
    assert len(ids) == len(JOBS) + 1 and all(job_id.isdigit() for job_id in ids.values()), ids


# -------------------------------------------------------------------------------------------------------
# Tests
# -------------------------------------------------------------------------------------------------------

def test_shellcheck_slurm_scripts():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (.ci/install_slurm.sh installs it)")
    scripts = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, "slurm")) for f in sorted(files)
               if f.endswith((".sh", ".sbatch"))]
    scripts.append(os.path.join(ROOT, ".ci", "install_slurm.sh"))
    assert len(scripts) >= 5, scripts
    proc = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_node_job_completes(jobs):
    job_id, info, dump, log = jobs["reference"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-4000:]}"
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]", info
    assert "world 2 = dp_replicate 1 x dp_shard 2" in out, out[-4000:]
    # one torchrun agent per node joined the rendezvous, each as its own node rank (srun labels every line
    # with the task id, one task per node; which node becomes rank 0 is up to the rendezvous)
    node_ranks = dict(re.findall(r"^(\d+): .*\]\s+group_rank=(\d+)$", out, re.M))
    assert sorted(node_ranks) == ["0", "1"] and sorted(node_ranks.values()) == ["0", "1"], out[-4000:]
    assert len(re.findall(r"^\d+: .*\]\s+group_world_size=2$", out, re.M)) == 2, out[-4000:]
    steps = [s for s, _ in losses(dump)]
    assert steps == list(range(1, STEPS + 1))
    assert os.path.isdir(os.path.join(dump, "checkpoint", f"step-{STEPS}"))


@pytest.mark.slow
def test_time_limit_checkpoints_requeues_and_resumes_exactly(jobs):
    """The time-limit job of `jobs`: warned, checkpointed, requeued, resumed, and equal to the reference."""
    job_id, info, dump, log = jobs["timelimit"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-5000:]}"
    assert "SIGUSR1: the time limit is near" in out and "requeueing job" in out, out[-5000:]
    # The warning stopped the job at a checkpoint of the step it was on; the requeued job resumed from it.
    stopped = [int(k) for k in re.findall(r"stopping at step (\d+) on signal", out)]
    assert len(stopped) == 1 and info["Restarts"] == "1", f"{info}\n{out[-5000:]}"
    k = stopped[0]
    assert WARN_AT <= k < STEPS, stopped
    assert re.search(rf"resumed from \S*step-{k} at step {k}", out), out[-5000:]
    assert {f"step-{k}", f"step-{STEPS}"} <= set(os.listdir(os.path.join(dump, "checkpoint")))

    got, want = losses(dump), losses(jobs["reference"][2])
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), "every step logged once, none repeated"
    assert got == want, next(f"step {a[0]}: {a[1]!r} != {b[1]!r}" for a, b in zip(got, want) if a != b)


@pytest.mark.slow
def test_preflight_job_checks_both_nodes(jobs):
    """sbatch slurm/preflight.sbatch: multinode.sbatch's launch with preflight.py check on the two nodes."""
    job_id, info, dump, log = jobs["preflight"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-4000:]}"
    assert "rank(s) per node, rendezvous" in out and "preflight.py check, config configs/debug_model.toml" in out
    rows = re.findall(r"^\d: +([01])  (n\d) +CPU ", out, re.M)  # srun's label, then the rank's row
    # two of the three nodes, whichever the other jobs left free
    assert sorted(r for r, _ in rows) == ["0", "1"] and len({n for _, n in rows}) == 2, out[-4000:]
    checks = {c: lv for lv, c in re.findall(r"^\d: (OK|WARN|FAIL) +([^:]+):", out, re.M)}
    for check in ("software", "matmul", "bandwidth within nodes", "bandwidth across nodes", "data manifest",
                  "data source 'c4' (assets/data/c4)",
                  "validation source 'finemath' (assets/data/finemath)", f"dump folder {dump}", "free space",
                  "tokenizer assets/tokenizer/tokenizer.model"):
        assert check in checks, (check, out[-4000:])
    assert "FAIL" not in checks.values(), out[-4000:]
    assert re.search(r"^\d: OK +bandwidth across nodes: 2 nodes: busbw", out, re.M), out[-4000:]
    assert re.search(r"^\d: preflight: 0 FAIL, \d WARN of 16 checks", out, re.M), out[-4000:]


# -------------------------------------------------------------------------------------------------------
# Recovery: a lost rank, with and without a spare node; a crash loop; a user error; torchrun alone
# -------------------------------------------------------------------------------------------------------

def recovery_seconds(dump) -> float:
    """From the kill (tests/kill_rank.py's time) to the end of the first step trained again."""
    with open(os.path.join(dump, "killed")) as f:
        killed = float(f.read())
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    last = max(r["step"] for r in records if r["time"] < killed)
    return next(r["time"] for r in records if r["time"] > killed and r["step"] <= last) - killed


def assert_resumed_exactly(dump, reference_dump, out):
    got, want = losses(dump), losses(reference_dump)
    assert [s for s, _ in want] == list(range(1, STEPS + 1))
    resumed = [int(k) for k in re.findall(r"resumed from \S*step-(\d+) at step", out)]
    assert len(resumed) == 1 and resumed[0] >= 5, out[-5000:]
    k = resumed[0]
    again = [(s, x) for s, x in got if s > k][-(STEPS - k):]  # the resumed launch's steps
    assert [s for s, _ in again] == list(range(k + 1, STEPS + 1)), got
    assert again == want[k:], next(f"step {a[0]}: {a[1]!r} != {b[1]!r}" for a, b in zip(again, want[k:]) if a != b)
    assert dict(got) == dict(want)  # every step's last loss


@pytest.mark.slow
def test_a_lost_rank_is_replaced_by_the_spare_node(jobs):
    """SPARE_NODES=1 on 3 nodes: training on n1 n2; a rank on n2 killed; relaunched on n1 n3 in the same
    allocation (no requeue); the losses after the resume equal the uninterrupted 2-node run's bit for bit."""
    job_id, info, dump, log = jobs["spare"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-5000:]}"
    assert info["Restarts"] == "0", info  # the same allocation
    assert "(training on n1 n2; spare: n3)" in out, out[-5000:]
    line = re.search(r"multinode.sbatch: restart 1 of 3 \(MAX_RESTARTS\): n2 failed: rank [01] killed by SIGKILL; "
                     r"spare n3 in its place; resuming from step-(\d+); steps to train again: (\d+)", out)
    assert line, out[-5000:]
    assert "world 2 = dp_replicate 1 x dp_shard 2" in out.split(line[0])[1]
    assert_resumed_exactly(dump, jobs["reference"][2], out)
    assert re.search(r"multinode.sbatch: goodput \d+\.\d%: .*; failures: 1, restarts: 1, requeues: 0, steps trained twice: [1-9]",
                     out), out[-3000:]
    record = json.loads(open(os.path.join(dump, "metrics.jsonl")).read().splitlines()[-1])
    assert record["record"] == "goodput" and record["restarts"] == 1 and 0 < record["goodput"] < 1, record
    assert record["steps_kept"] == STEPS and "step" not in record, record
    print(f"recovery with a spare: {recovery_seconds(dump):.1f} s from the kill to the next trained step")


@pytest.mark.slow
def test_a_lost_rank_without_a_spare_requeues_without_its_node(jobs):
    """--nodes 2 on the 3-node cluster, no spare: requeued with n2 excluded, it runs on n1 n3 and resumes exactly."""
    job_id, info, dump, log = jobs["no_spare"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-5000:]}"
    assert info["Restarts"] == "1" and info["NodeList"] == "n[1,3]" and info["ExcNodeList"] == "n2", info
    assert re.search(r"restart 1 of 3 \(MAX_RESTARTS\): n2 failed: rank [01] killed by SIGKILL; requeue without n2;",
                     out), out[-5000:]
    assert f"requeued job {job_id} without n2" in out and "(restart 1) on 2 node(s) n[1,3]" in out, out[-5000:]
    assert_resumed_exactly(dump, jobs["reference"][2], out)
    assert re.search(r"goodput \d+\.\d%: .*; failures: 1, restarts: 1, requeues: 1, steps trained twice: [1-9]", out), out[-3000:]
    print(f"recovery by requeue: {recovery_seconds(dump):.1f} s from the kill to the next trained step")


@pytest.mark.slow
def test_a_job_that_loses_a_node_and_gets_none_goes_on_with_the_node_it_has(jobs, tmp_path):
    """--nodes 2 without n3, no spare: a rank on n2 killed, and a requeue without n2 would find 1 node for a job of
    2. The job relaunches on n1 alone in the same allocation (MIN_NODES: 1 by default, half of 2), one line saying
    the layout and its accumulation, and resumes. At its time limit it requeues itself asking for 1 node (it
    asked for 2: on the partition without n2 and n3 it would stop), resumes and finishes. Its losses after the
    shrink equal, bit for bit, those of
    train.py on 1 process resuming from a copy of the checkpoint the shrink resumed from: the same layout (1 rank,
    4 micro-batches of 1) on the same data, so the same arithmetic in the same order. (Against the 2-node launch the
    sums of a step's gradients run in another order: fp32 rounding apart, not bitwise.)"""
    job_id, info, dump, log = jobs["shrink"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-5000:]}"
    assert info["Restarts"] == "1" and info["ExcNodeList"] == "n2,n3" and info["NumNodes"] == "1", info
    assert "(training on n1 n2; spare: none)" in out, out[-5000:]
    assert re.search(r"world 2 = dp_replicate 1 x dp_shard 2 x tp 1, .*grad accumulation 2;", out), out[-5000:]
    line = re.search(r"multinode.sbatch: restart 1 of 3 \(MAX_RESTARTS\): n2 failed: rank [01] killed by SIGKILL; no "
                     r"spare, and the partition has 1 node\(s\) for a job of 2: relaunching on 1 of the 1 node\(s\) "
                     r"left: world 1 = dp 1 x tp 1, grad accumulation 4 \(global batch 4, 2 data streams\); resuming "
                     r"from step-(\d+)", out)
    assert line, out[-5000:]
    after = out.split(line[0])[1]
    assert re.search(r"world 1 = dp_replicate 1 x dp_shard 1 x tp 1, .*grad accumulation 4;", after), after[-5000:]
    k = int(line[1])
    assert re.search(rf"resumed from \S*step-{k} at step {k}", after), after[-5000:]
    assert f"requeued job {job_id} without n2,n3 on 1 node(s)" in after, after[-5000:]  # after the warning
    assert "(restart 1) on 1 node(s) n1 (training on n1; spare: none)" in after, after[-5000:]
    got = losses(dump)
    assert sorted(dict(got)) == list(range(1, STEPS + 1)), got
    shrunk = [(s, x) for s, x in got if s > k][-(STEPS - k):]  # the launch on n1
    assert [s for s, _ in shrunk] == list(range(k + 1, STEPS + 1)), got

    # train.py on 1 process from a copy of step-k (and the data manifest the run pinned)
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(dump, "checkpoint", f"step-{k}"), copy / "checkpoint" / f"step-{k}")
    shutil.copy(os.path.join(dump, "data_manifest.json"), copy / "data_manifest.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py",
           "--config", "configs/debug_model.toml", "--job.dump_folder", str(copy), *TRAIN_ARGS, *SHRINK_ARGS]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"at step {k}" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-5000:]
    alone = losses(copy)
    assert [s for s, _ in alone] == list(range(k + 1, STEPS + 1)), alone
    assert shrunk == alone, next(f"step {a[0]}: {a[1]!r} != {b[1]!r}" for a, b in zip(shrunk, alone) if a != b)
    # the same global batches as the reference (2 nodes, 1 micro-batch of 2 each): fp32 rounding apart (1e-6 seen)
    want = dict(losses(jobs["reference"][2]))
    assert all(loss == pytest.approx(want[step], rel=1e-5) for step, loss in got), (got, want)
    assert re.search(r"goodput \d+\.\d%: .*; failures: 1, restarts: 1, requeues: 1, steps trained twice: [1-9]", out), \
        out[-3000:]


def logged_at(out: str, pattern: str) -> float:
    """The unix time of multinode.sbatch's first line matching pattern (its lines start with the date)."""
    m = re.search(rf"^(\S+ \S+) multinode.sbatch: .*{pattern}", out, re.M)
    assert m, (pattern, out[-5000:])
    return time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S"))


def measured_training(dump, out, bounds: list) -> float:
    """The kept steps' training time as train.py timed them: a training record's tps (tokens per second on the one
    rank, the saves timed apart) gives its steps' seconds. Each launch (its records between bounds) kept the steps
    from the checkpoint it resumed from to the one the next launch resumed from, one it did not log at its mean."""
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    resumed = [0] + [int(k) for k in re.findall(r"resumed from \S*step-(\d+) at step", out)]
    assert len(resumed) == len(bounds) + 1, out[-5000:]
    total = 0.0
    for lo, hi, first, last in zip([0, *bounds], [*bounds, math.inf], resumed, resumed[1:] + [STEPS]):
        seconds, prev = {}, first
        for r in (r for r in records if lo < r["time"] < hi):
            seconds.update({s: r["tokens_seen"] / r["step"] / r["tps"] for s in range(prev + 1, r["step"] + 1)})
            prev = r["step"]
        mean = sum(seconds.values()) / len(seconds)
        total += sum(seconds.get(s, mean) for s in range(first + 1, last + 1))
    return total


@pytest.mark.slow
def test_a_node_swapped_for_a_spare_stays_out_and_the_goodput_leaves_out_the_queue(jobs, started_jobs):
    """SPARE_NODES=1 on 2 nodes, log_freq 2: a rank on n1 killed, the spare n2 trains in its place; then the
    time-limit warning. The requeued job, held in the queue for a minute (scontrol hold, then release), runs on
    n2 n3 without n1. Its goodput line's queue time is the one measured from the script's lines, its training time
    that of the kept steps measured from metrics.jsonl, each within 10%."""
    job_id, info, dump, log = jobs["swap_requeue"]
    marks = started_jobs[5]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-5000:]}"
    assert info["Restarts"] == "1" and info["NodeList"] == "n[2-3]" and info["ExcNodeList"] == "n1", info
    assert re.search(r"restart 1 of 3 \(MAX_RESTARTS\): n1 failed: rank 0 killed by SIGKILL; spare n2 in its place",
                     out), out[-5000:]
    assert f"requeued job {job_id} without n1" in out, out[-5000:]
    assert "(restart 1) on 2 node(s) n[2-3] (training on n2; spare: n3)" in out, out[-5000:]

    line = re.search(r"goodput ([\d.]+)%: ([\d.]+) s of the ([\d.]+) s .*steps trained twice: (\d+); time lost: "
                     r"queued ([\d.]+) s, start up ([\d.]+) s, trained again ([\d.]+) s, skipped steps ([\d.]+) s, "
                     r"saving ([\d.]+) s, "
                     r"failures ([\d.]+) s, other ([\d.]+) s", out)
    assert line, out[-3000:]
    goodput, kept, wall, twice, queued, *lost = map(float, line.groups())
    assert twice >= 1 and abs(kept + queued + sum(lost) - wall) < 0.5, line[0]
    queued_measured = logged_at(out, r"\(restart 1\) on") - logged_at(out, "stopped cleanly after the warning")
    assert queued >= marks["released"] - marks["held"] >= HOLD, (line[0], marks)
    assert abs(queued - queued_measured) <= 0.1 * queued_measured, (line[0], queued_measured)
    with open(os.path.join(dump, "killed")) as f:
        killed = float(f.read())
    trained_measured = measured_training(dump, out, [killed, marks["held"]])
    assert abs(kept - trained_measured) <= 0.1 * trained_measured, (line[0], trained_measured)
    print(f"goodput line: {line[0]}; measured: queued {queued_measured:.0f} s, trained {trained_measured:.1f} s")


@pytest.mark.slow
def test_a_crash_loop_stops_with_one_summary_line(jobs):
    """A rank killed after its first step at every launch, so no checkpoint ever comes: the first restart that
    got no newer checkpoint passes MAX_STALLED_RESTARTS=0 and the job ends FAILED with the summary line."""
    job_id, info, dump, log = jobs["crash_loop"]
    out = read(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", f"{info}\n{out[-5000:]}"
    assert info["Restarts"] == "1", info  # the first failure requeued the job without its node
    assert len(re.findall(r"multinode.sbatch: restart \d of 3", out)) == 1, out[-5000:]
    summary = re.findall(r"multinode.sbatch: giving up after 2 failures \(restarts without a newer checkpoint in the "
                         r"last 1 h of launches: 1, MAX_STALLED_RESTARTS=0\): nodes left out: (n\d); steps trained "
                         r"twice: 1; newest "
                         r"checkpoint step-0; last error: rank 0 killed by SIGKILL", out)
    assert len(summary) == 1, out[-5000:]
    assert re.search(r"goodput .*; failures: 2, restarts: 1, requeues: 1, steps trained twice: 1", out), out[-3000:]


@pytest.mark.slow
def test_a_user_error_is_not_restarted(jobs):
    job_id, info, dump, log = jobs["user_error"]
    out = read(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{out[-3000:]}"
    assert info["Restarts"] == "0", info
    assert re.search(r"multinode.sbatch: not restarted: a user error \(exit 2\) fails the same way again: "
                     r"unknown key in \[training\] 'stepz'", out), out[-3000:]
    assert "restart 1" not in out


@pytest.mark.slow
def test_a_hub_that_times_out_on_one_node_is_retried_without_that_node(jobs):
    """The first launch's ranks on task 1's node time out reading the Hub at start-up: every rank ends with the
    fault's line naming that node, exit 4 (not 2, a user's error), and the job is requeued without it and
    finishes on the nodes left."""
    job_id, info, dump, log = jobs["fault"]
    out = read(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{out[-5000:]}"
    node = re.search(r"\d: error: node (n\d): data source 'c4': reading hf://\S+ failed 10 times", out)
    assert node and "exitcode  : 4" in out, out[-5000:]
    assert re.search(rf"restart 1 of 3 \(MAX_RESTARTS\): {node[1]} failed: a fault of that node \(exit 4\); "
                     rf"requeue without {node[1]}", out), out[-5000:]
    assert [s for s, _ in losses(dump)] == list(range(1, STEPS + 1))  # the fault came before the first step
    assert os.path.isdir(os.path.join(dump, "checkpoint", f"step-{STEPS}"))


def recover_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("recover", os.path.join(ROOT, "slurm", "recover.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_failed_node_is_the_one_whose_rank_died_not_the_one_that_lost_its_peer():
    """srun's task 1 ran on n2; its rank was SIGKILLed, task 0's rank lost its peer (torchrun's reports, trimmed)."""
    recover = recover_module()
    lines = ["0: error: rank 1: a collective in forward (model.py:284) lost its connection to another rank, which "
             "ended: that rank's own error line or traceback says why",
             "1: Root Cause (first observed failure):", "1:   rank      : 0 (local_rank: 0)",
             "1:   exitcode  : -9 (pid: 16183)  (SIGKILL)", "0: Root Cause (first observed failure):",
             "0:   rank      : 1 (local_rank: 0)", "0:   exitcode  : 3 (pid: 16184) ",
             "srun: error: n1: task 0: Exited with exit code 1", "srun: error: n2: task 1: Exited with exit code 1"]
    found = recover.diagnose(lines, ["n1", "n2"], [])
    assert (found["node"], found["how"], found["user"]) == ("n2", "rank 0 killed by SIGKILL", False)
    assert recover.diagnose(lines, ["n1", "n2"], ["n1"])["node"] == "n1"  # Slurm's node state comes first
    only_lost = lines[:1] + lines[4:7] + ["srun: error: n2: task 1: Killed"]  # n2 froze: srun ended it
    assert recover.diagnose(only_lost, ["n1", "n2"], [])["node"] == "n2"
    user = recover.diagnose(["0: error: unknown key x", "0:   exitcode  : 2 (pid: 1)"], ["n1"], [])
    assert user["user"] and user["error"] == "unknown key x"
    assert recover.diagnose(["srun: error: n1: task 0: Exited with exit code 1"], ["n1", "n2"], [])["node"] == "n1"
    assert recover.diagnose([], ["n1", "n2"], [])["node"] is None
    fault = [f"{t}: error: node n2: data source 'c4': reading a file failed 10 times" for t in (0, 1)]
    fault += [f"{t}:   exitcode  : 4 (pid: 1)" for t in (0, 1)]
    assert recover.diagnose(fault, ["n1", "n2"], [])["node"] == "n2"  # the node the fault's line names
    # NCCL's watchdog aborts n1's rank, whose all-reduce waited 10 min for n2's (hung in a kernel: srun ends it)
    watchdog = ["0: [rank0]:[E1127 11:02:01.123 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                "600012 milliseconds before timing out.",
                "0: [rank0]:[E1127 11:02:01.124 ProcessGroupNCCL.cpp:2271] [PG ID 0 PG GUID 0(default_pg) Rank 0]  "
                "failure detected by watchdog at work sequence id: 812 PG status: last enqueued work: 812, last "
                "completed work: 811", "0: terminate called after throwing an instance of 'c10::DistBackendError'",
                "0: Root Cause (first observed failure):", "0:   rank      : 0 (local_rank: 0)",
                "0:   exitcode  : -6 (pid: 2201)  (SIGABRT)"]
    hung = watchdog + ["srun: error: n1: task 0: Exited with exit code 1", "srun: error: n2: task 1: Killed"]
    assert recover.diagnose(hung, ["n1", "n2"], [])["node"] == "n2"  # not n1, the rank the watchdog aborted
    both = watchdog + [line.replace("0: ", "1: ", 1).replace("rank0", "rank1").replace("Rank 0", "Rank 1")
                       .replace(": 0 (local", ": 1 (local") for line in watchdog]
    assert recover.diagnose(both, ["n1", "n2"], [])["node"] is None  # every rank timed out: no node to blame
    # n2's own GPU failed (the watchdog's other lines follow a CUDA error too), and n1's rank timed out waiting
    cuda = ["1: [rank1]:[E1127 11:01:58.001 ProcessGroupNCCL.cpp:1899] CUDA error: an illegal memory access was "
            "encountered", both[len(watchdog) + 1], *both[-3:]]
    assert recover.diagnose(watchdog + cuda, ["n1", "n2"], [])["node"] == "n2"
    # the excuse is a rank's, not its node's: n1's rank 1 aborted with no timeout line of its own
    other_rank = watchdog + ["0:   rank      : 1 (local_rank: 1)", "0:   exitcode  : -6 (pid: 2202)  (SIGABRT)"]
    assert recover.diagnose(other_rank, ["n1", "n2"], [])["node"] == "n1"
    nan = [f"{t}: error: step 9: the loss or the gradient norm is not finite" for t in (0, 1)]
    nan += [f"{t}:   exitcode  : 3 (pid: 1)" for t in (0, 1)]
    assert recover.diagnose(nan, ["n1", "n2"], [])["node"] is None  # every rank alike: no node to blame


class FakeJob:
    """A job as multinode.sbatch drives recover.py (start, ended after each launch, end), on a clock the
    test sets, with the run's metrics.jsonl and launch lines written as train.py writes them."""

    def __init__(self, tmp_path, monkeypatch):
        self.recover = recover_module()
        self.clock = [0.0]
        monkeypatch.setattr(self.recover.time, "time", lambda: self.clock[0])
        self.dump = tmp_path / "dump"
        (self.dump / "checkpoint").mkdir(parents=True)
        self.record = str(tmp_path / "job.recovery.json")
        self.log = tmp_path / "job.out"
        self.log.write_text("")

    def at(self, t):
        self.clock[0] = t
        return self

    def start(self, t):
        self.at(t).recover.main(["start", self.record, "--job", "7"])

    def launch(self, start, end, code, resumed, records, saves=None):
        """A launch from `start` to `end` (srun's status `code`) that resumed from step-`resumed` (0: none),
        logged the training records {step: time}, and ended with train.py's `done:` line (its saves' seconds)."""
        offset = self.log.stat().st_size
        lines = [f"0: ...; config in {self.dump}/config.toml"]
        lines += [f"0: resumed from {self.dump}/checkpoint/step-{resumed} at step {resumed}"] if resumed else []
        lines += [f"0: done: step 9, 9 tokens, 1m wall; loss 2.0; validation 0.0s, evals 0.0s, saves {saves}s"
                  ] if saves is not None else []
        with open(self.log, "a") as f:
            f.write("\n".join(lines) + "\n")
        with open(self.dump / "metrics.jsonl", "a") as f:
            for s, t in records.items():  # one rank, 128 tokens a step, a step a second as train.py times it
                f.write(json.dumps({"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": t}) + "\n")
        self.at(end).recover.main(["ended", self.record, "--log", str(self.log), "--offset", str(offset),
                                   "--since", str(start), "--code", str(code), "--ranks", "1"])

    def end(self, t, capsys) -> tuple:
        """The goodput line's numbers ({name: seconds}) and metrics.jsonl's goodput record."""
        capsys.readouterr()
        self.at(t).recover.main(["end", self.record])
        line = self.line = capsys.readouterr().err
        assert "goodput" in line, line
        numbers = {"trained": float(re.search(r"goodput [\d.]+%: ([\d.]+) s of the", line)[1])}
        lost = re.findall(r"(queued|start up|trained again|skipped steps|saving|failures|other) ([\d.]+) s", line)
        numbers.update({name: float(x) for name, x in lost})
        numbers.update({name: int(x) for name, x in re.findall(r"(steps trained twice|requeues): (\d+)", line)})
        goodput = json.loads((self.dump / "metrics.jsonl").read_text().splitlines()[-1])
        return numbers, goodput


def test_goodput_leaves_out_the_queue_the_start_up_and_the_saves(tmp_path, monkeypatch, capsys):
    """The issue's job: 34 s of training, a time-limit requeue an hour in the queue, 6 s more. Each step
    takes 1 s; each launch 20-30 s of start-up before its first step, 2-3 s to save (1-2 s) and exit at its end."""
    job = FakeJob(tmp_path, monkeypatch)
    job.start(0.0)
    job.launch(10.0, 77.0, 0, 0, {s: 40.0 + s for s in range(1, 35)}, saves=2.0)  # stopped at 34: the warning
    job.start(3677.0)  # an hour queued
    job.launch(3680.0, 3708.0, 0, 34, {s: 3666.0 + s for s in range(35, 41)}, saves=1.0)
    numbers, record = job.end(3709.0, capsys)
    assert numbers == {"trained": 40.0, "queued": 3600.0, "start up": 63.0, "trained again": 0.0,
                       "skipped steps": 0.0, "saving": 3.0, "failures": 0.0, "other": 3.0, "steps trained twice": 0,
                       "requeues": 1}
    assert record["record"] == "goodput" and "step" not in record, record  # no training step's key
    assert record["steps_kept"] == 40 and record["goodput"] == pytest.approx(40 / 3709)
    assert record["wall_seconds"] == 3709.0 and record["lost_seconds"]["queued"] == 3600.0


def test_goodput_takes_the_steps_trained_again_from_the_checkpoint_resumed(tmp_path, monkeypatch, capsys):
    """log_freq 10, a checkpoint every 25 steps (2 s each): a rank fails after step 33, the spare's launch
    resumes from step-25. Steps 26-30 (logged) are trained again, not 21-30 as the logged steps suggest;
    31-33 (not logged) and the wait for the ranks to stop go to failures."""
    job = FakeJob(tmp_path, monkeypatch)
    job.start(0.0)
    # launch 1: start-up 20 s, then a step a second, a save after step 25; the rank fails at 55.5 s
    job.launch(0.0, 57.0, 1, 0, {1: 21.0, 10: 30.0, 20: 40.0, 30: 52.0})
    job.launch(60.0, 98.0, 0, 25, {30: 75.0, 40: 85.0, 50: 95.0})  # start-up 10 s; the last save 3 s
    numbers, record = job.end(99.0, capsys)
    assert numbers == {"trained": 50.0, "queued": 0.0, "start up": 30.0, "trained again": 5.0, "skipped steps": 0.0,
                       "saving": 5.0, "failures": 8.0, "other": 1.0, "steps trained twice": 5, "requeues": 0}
    assert record["steps_kept"] == 50 and record["steps_trained_twice"] == 5


def test_goodput_counts_the_steps_a_rewind_trains_again(tmp_path, monkeypatch, capsys):
    """Repeated loss spikes rewind the run from step 9 to its step-6 (pretrain/spikes.py's record): steps 7-9 are
    trained twice, and their first second each is time lost, not the kept steps' nor a save's."""
    job = FakeJob(tmp_path, monkeypatch)
    job.start(0)
    records = [{"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": 10.0 + s} for s in range(1, 10)]
    records.append({"step": 9, "rewound_to": 6, "tokens_seen": 768, "time": 19.5})
    records += [{"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": 13.5 + s} for s in range(7, 13)]
    with open(job.dump / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    job.launch(9, 26, 0, 0, {}, saves=0.0)
    numbers, goodput = job.end(26, capsys)
    assert goodput["steps_kept"] == 12 and goodput["goodput_seconds"] == pytest.approx(12.0), goodput
    assert numbers["steps trained twice"] == 3 and numbers["trained again"] == pytest.approx(3.0), numbers
    assert numbers["saving"] == 0.0, numbers


def test_goodput_counts_a_skipped_steps_time_as_lost(tmp_path, monkeypatch, capsys):
    """A loss spike skips steps 4 and 5 (pretrain/spikes.py's records): their updates were thrown away, so their
    seconds are lost to skipped steps, not the kept steps' time; a rewind then trains step 5 again and keeps it."""
    job = FakeJob(tmp_path, monkeypatch)
    job.start(0)
    records = [{"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": 10.0 + s} for s in (1, 2, 3)]
    records += [{"step": s, "skipped": "spike", "step_loss": 9.0, "time": 10.0 + s} for s in (4, 5)]
    records += [{"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": 10.0 + s} for s in (6, 8)]
    records.append({"step": 8, "rewound_to": 4, "tokens_seen": 512, "time": 18.5})  # 6-8 again; 5 too, and kept
    records += [{"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": 14.5 + s} for s in (5, 10)]
    with open(job.dump / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    job.launch(9, 25, 0, 0, {}, saves=0.0)
    numbers, goodput = job.end(25, capsys)
    assert goodput["lost_seconds"]["skipped_steps"] == pytest.approx(2.0), goodput  # steps 4 and 5, once each
    assert goodput["steps_kept"] == 9 and goodput["goodput_seconds"] == pytest.approx(9.0), goodput  # 1-3, 5-10
    assert numbers["steps trained twice"] == 3 and numbers["trained again"] == pytest.approx(3.0), numbers  # 6-8
    assert "trained again 3.0 s, skipped steps 2.0 s, saving" in job.line, job.line


def test_goodput_places_skips_around_rounds_rewinds_and_a_clean_ends_tail(tmp_path, monkeypatch, capsys):
    """Skipped steps wherever the log puts them: after a 2 s validation round (the round stays other), before a
    rewind with no training record between (steps 8 and 9 skipped, 7 trained again), and in a clean end's unlogged
    tail up to the checkpoint the next launch resumes from (12). A skip's record from before they carried their
    time is passed by, not a crash. A step takes 1 s."""
    job = FakeJob(tmp_path, monkeypatch)

    def step(s, t):
        return {"step": s, "loss": 2.0, "tokens_seen": 128 * s, "tps": 128.0, "time": t}

    records = [step(s, 10.0 + s) for s in (1, 2, 3, 4)]
    records += [{"step": 4, "validation_loss": 3.0, "validation_seconds": 2.0},
                {"step": 5, "skipped": "spike", "time": 17.0}, step(6, 18.0), {"step": 7, "skipped": "spike"},
                {"step": 8, "skipped": "spike", "time": 20.0}, {"step": 9, "skipped": "spike", "time": 21.0},
                {"step": 9, "rewound_to": 6, "tokens_seen": 768, "time": 21.0}]
    records += [step(s, 15.0 + s) for s in (7, 8, 9, 10)] + [{"step": 12, "skipped": "spike", "time": 27.0}]
    records.append(step(13, 38.0))  # the next launch's
    with open(job.dump / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    job.start(0)
    job.launch(9, 30, 0, 0, {}, saves=1.0)  # stopped on the warning at step 12, saved it
    job.start(32)
    job.launch(35, 40, 0, 12, {}, saves=0.0)
    numbers, goodput = job.end(40, capsys)
    assert goodput["lost_seconds"]["skipped_steps"] == pytest.approx(4.0), goodput  # 5, 8, 9, 12
    assert goodput["steps_kept"] == 11 and goodput["goodput_seconds"] == pytest.approx(11.0), goodput
    assert numbers["steps trained twice"] == 1 and numbers["trained again"] == pytest.approx(1.0), numbers  # 7
    assert numbers["other"] == pytest.approx(2.0 + 2.0 + 2.0), numbers  # the round, each launch's exit
    assert sum(v for k, v in numbers.items() if k not in ("steps trained twice", "requeues")) == pytest.approx(40.0)


def test_a_stall_weeks_ago_does_not_add_to_a_crash_loop(tmp_path, capsys):
    """MAX_STALLED_RESTARTS counts restarts without a newer checkpoint within the last hour of launches."""
    recover = recover_module()
    dump = tmp_path / "dump"
    (dump / "checkpoint" / "step-5").mkdir(parents=True)
    (dump / "checkpoint" / "step-5" / ".metadata").write_text("")
    log = tmp_path / "job.out"
    log.write_text(f"0: ...; config in {dump}/config.toml\nsrun: error: n1: task 0: Exited with exit code 1\n")
    path = str(tmp_path / "job.recovery.json")

    def failure_after(previous_stall_launched: float) -> str:
        failures = [{"resumed": 5, "stalled": False, "launched": 0.0},  # the restart that stalled below
                    {"resumed": 5, "stalled": True, "launched": previous_stall_launched}]
        launches = [{"start": 0.0, "end": 7400.0, "code": 1, "resumed": 5}]  # 7,400 s of launches so far
        with open(path, "w") as f:
            json.dump({"job": "7", "first_start": 0.0, "starts": 3, "started": [0.0], "launches": launches,
                       "failures": failures, "restarts": 2, "left_out": [], "stalled": 1, "dump_folder": ""}, f)
        capsys.readouterr()
        recover.main(["failed", path, "--log", str(log), "--nodes", "n1 n2", "--max_restarts", "5",
                      "--max_stalled", "1"])
        return capsys.readouterr()

    out = failure_after(100.0)  # two hours of launches ago
    assert out.out.strip() == "requeue n1", out
    out = failure_after(7000.0)  # a restart ago, minutes of launches: a crash loop
    assert out.out.strip() == "stop 1", out
    assert "restarts without a newer checkpoint in the last 1 h of launches: 2, MAX_STALLED_RESTARTS=1" in out.err


def test_every_requeue_excludes_every_node_the_job_left_out(tmp_path, capsys):
    """A node left out (a spare took its place) stays out of each later start and requeue; too few nodes
    left: one line, exit 1."""
    recover = recover_module()
    path = str(tmp_path / "job.recovery.json")
    recover.start(path, "7")
    record = json.load(open(path))
    record["left_out"] = ["n2"]
    recover.save(record, path)
    capsys.readouterr()
    recover.main(["start", path, "--job", "7"])  # the script keeps these out of the allocation
    assert capsys.readouterr().out.strip() == "1 n2"  # (after the first start's training nodes)
    partition = ["--excluded", "n4", "--partition", "n1 n2 n3 n4 n5"]
    recover.main(["requeue", path, *partition, "--nnodes", "3"])
    assert capsys.readouterr().out.strip() == "3 n2,n4"  # as many nodes, without its own exclusions and the left out
    with pytest.raises(SystemExit) as stopped:
        recover.main(["requeue", path, *partition, "--nnodes", "4"])
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and re.search(r"not requeued: without n2 n4 \(failed and left out: n2\), the "
                                                 r"partition has 3 node\(s\) for a job of 4, and not shrinking \(the "
                                                 r"run's config.toml cannot be read\): remove a repaired", err), err


def test_a_requeue_onto_too_few_nodes_asks_for_fewer(tmp_path, capsys):
    """A job that shrank after a failure (its node left out, no other to get) reaches its time limit: the requeue
    asks for the most nodes the partition has left that the run's batch and streams divide into (as a shrink
    does), its spares beside them, down to MIN_NODES; below that it stops with one line."""
    recover = recover_module()
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "config.toml").write_text("[training]\nglobal_batch_size = 8\nlocal_batch_size = 1\n"
                                      "[data]\nnum_streams = 4\n")
    path = str(tmp_path / "job.recovery.json")
    assert recover.start(path, "7", 4) == "4"  # the first start's training nodes; none left out
    assert recover.start(path, "7", 2) == "4"  # a requeue's start on fewer keeps the first's count
    record = json.load(open(path))
    record.update(left_out=["n2"], dump_folder=str(dump))
    recover.save(record, path)
    partition = ["--excluded", "n4", "--partition", "n1 n2 n3 n4 n5", "--nnodes", "4", "--nproc_per_node", "2"]
    for spares, asked in ((0, "2"), (1, "3")):  # 3 nodes left: 3 x 2 ranks do not divide 4 streams, 2 x 2 do
        capsys.readouterr()
        recover.main(["requeue", path, *partition, "--min_nodes", "2", "--spares", str(spares)])
        out = capsys.readouterr()
        assert out.out.strip() == f"{asked} n2,n4", out
        assert ("the partition has 3 node(s) for a job of 4: requeueing on 2 of the " f"{3 - spares} node(s) left: "
                "world 4 = dp 4 x tp 1, grad accumulation 2 (global batch 8, 4 data streams)") in out.err, out.err
    with pytest.raises(SystemExit) as stopped:
        recover.main(["requeue", path, *partition, "--min_nodes", "3"])
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "not shrinking (no node count from 3 down to MIN_NODES=3 divides" in err, err


def test_a_job_that_lost_a_node_and_can_get_none_shrinks_to_what_its_batch_divides_into(tmp_path, capsys):
    """No spare, and a requeue would find too few nodes: `failed` relaunches on the most nodes left, down to
    MIN_NODES, whose DP degree (nodes x ranks per node / TP) divides the run's fixed data streams and whose
    micro-batches the global batch divides (its config.toml); the line names the layout and its accumulation.
    A partition with room requeues; a batch that follows the GPU count or no count that divides requeues with why."""
    recover = recover_module()
    dump = tmp_path / "dump"
    dump.mkdir()
    log = tmp_path / "job.out"
    log.write_text(f"0: ...; config in {dump}/config.toml\nsrun: error: n2: task 1: Exited with exit code 1\n")

    def failed(config, nodes="n1 n2 n3 n4", partition="n1 n2 n3 n4", min_nodes=2, nproc=8):
        (dump / "config.toml").write_text(config)
        path = str(tmp_path / f"job{len(list(tmp_path.iterdir()))}.recovery.json")
        recover.start(path, "7")
        capsys.readouterr()
        recover.main(["failed", path, "--log", str(log), "--nodes", nodes, "--excluded", "n9", "--partition",
                      partition, "--nnodes", str(len(nodes.split())), "--min_nodes", str(min_nodes),
                      "--nproc_per_node", str(nproc)])
        out = capsys.readouterr()
        assert json.load(open(path))["left_out"] == ["n2"]  # out of every later launch and requeue
        return out.out.strip(), out.err

    fixed = ("[training]\nglobal_batch_size = 64\nlocal_batch_size = 1\n[data]\nnum_streams = 64\n"
             "[parallelism]\ntensor_parallel_degree = 1\ndata_parallel_shard_degree = -1\n")
    action, line = failed(fixed)  # 3 nodes left, DP 24 does not divide 64 streams: 2 train, 1 is a spare
    assert action == "shrink n1,n3 n4", line
    assert re.search(r"restart 1 of 3 \(MAX_RESTARTS\): n2 failed: task 1: Exited with exit code 1; "
                     r"no spare, and the partition has 3 node\(s\) for a job of 4: relaunching on 2 of the 3 node\(s\) "
                     r"left: world 16 = dp 16 x tp 1, grad accumulation 4 \(global batch 64, 64 data streams\); "
                     r"resuming from step-0", line), line
    assert failed(fixed, partition="n1 n2 n3 n4 n5")[0] == "requeue n2"  # a requeue finds 4 nodes: the whole job
    action, line = failed(fixed, min_nodes=3)
    assert action == "requeue n2" and ("not shrinking (no node count from 3 down to MIN_NODES=3 divides global batch "
                                       "64 and 64 data streams at 8 rank(s) per node, tp 1)") in line, line
    action, line = failed(fixed, nodes="n1 n2", partition="n1 n2")
    assert action == "requeue n2" and "not shrinking (1 node(s) left, below MIN_NODES=2)" in line, line
    seventy = fixed.replace("64", "256", 1).replace("= 1\n[data]", "= 8\n[data]").replace("64", "32")
    seventy = seventy.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 8")
    sixteen = " ".join(f"n{i}" for i in range(1, 17))
    action, line = failed(seventy, nodes=sixteen, partition=sixteen)  # TP 8: a node is a DP rank; 8 of 15 left
    assert action == "shrink n1,n3,n4,n5,n6,n7,n8,n9 n10,n11,n12,n13,n14,n15,n16", line
    assert "world 64 = dp 8 x tp 8, grad accumulation 4 (global batch 256, 32 data streams)" in line, line
    action, line = failed(fixed.replace("= 64\nlocal", "= -1\nlocal"))
    assert action == "requeue n2" and "training.global_batch_size = -1 and data.num_streams = 64 follow the GPU count" \
        in line, line


def test_the_job_record_counts_starts_and_is_never_another_jobs(tmp_path):
    recover = recover_module()
    path = str(tmp_path / "train.recovery.json")  # --output=train.log: one log name for every job
    recover.start(path, "7")
    recover.start(path, "7")  # a requeue
    assert json.load(open(path))["starts"] == 2
    recover.start(path, "8")
    assert json.load(open(path))["job"] == "8" and json.load(open(path))["starts"] == 1


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_killed_rank_exactly(fsdp_reference, tmp_path):
    """One node, no Slurm: `torchrun --max-restarts 1` restarts both ranks after one is SIGKILLed at step 7 or
    later; they resume from step-5 and every step's loss equals the uninterrupted run's (conftest.py's)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kill_rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
           "--metrics.log_freq", "1", "--validation.enable", "false", "--training.steps", "10", *SMALL,
           "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    killed = kill_rank.kill_after(proc.pid, os.path.join(tmp_path, "metrics.jsonl"), 7, timeout=300)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and killed, out[-5000:]
    assert "resumed from" in out and "step-5 at step 5" in out, out[-5000:]
    assert "failed (exitcode: " in out, out[-5000:]  # torchrun saw the kill (-9) or the survivor's exit 3 first
    assert 'train.py", line' not in out, out[-5000:]  # the survivor: no traceback (a lost rank's line, or none)
    got, want = losses(tmp_path), losses(fsdp_reference[0])
    assert len(got) > 10 and got[-5:] == want[5:], (got, want)  # steps 6-10, trained again
    assert dict(got) == dict(want)
