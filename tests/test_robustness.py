"""Failures that must not cost a run: divergence, a full disk, a second job on the same folder.
Runs train conftest.SMALL (2 blocks, seq 64; the data error's at seq 256): what fails is not the model's
size."""

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this file run as a script (two_runs, slow_runs) imports conftest and train
    sys.path.insert(0, ROOT)

from conftest import SMALL, run_training  # noqa: E402


def cmd(dump, *args):
    return [sys.executable, "train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
            "--metrics.log_freq", "1", "--validation.enable", "false", *SMALL, *map(str, args)]


def run(dump, *args, env=None):
    """`python train.py` (cmd) forked as conftest.run_training forks it; env: variables to set."""
    return run_training(cmd(dump, *args)[2:], env=env)


def errors(proc):
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]


def tensorboard_steps(dump, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(dump / "tb"))
    tb.Reload()
    return [e.step for e in tb.Scalars(tag)] if tag in tb.Tags()["scalars"] else []


@pytest.fixture(scope="module")
def slow_runs_launch(tmp_path_factory):
    """(torchrun process, dump folder, its output file) of slow_runs (below), started by the first test that asks:
    its minute of waiting (reads and writes held back 8 to 20 s) overlaps this file's other tests."""
    dump = tmp_path_factory.mktemp("slow_runs")
    output = dump / "output.txt"
    with open(output, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 __file__, "slow_runs", str(dump)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    yield proc, dump, output
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_the_slow_reads_and_writers_start_before_the_other_tests(slow_runs_launch):
    """Only starts them: test_slow_reads_and_slow_writers_are_waited_for_as_long_as_they_may_take checks them."""
    assert slow_runs_launch[0].pid > 0


@pytest.mark.slow
def test_non_finite_loss_stops_without_saving_it(tmp_path):
    """The async save of step 1, still in flight when step 2 diverges, is put in place before the exit, and the
    TensorBoard events of step 1 are on disk."""
    proc = run(tmp_path, "--training.steps", 9, "--optimizer.lr", 1e30, "--lr_scheduler.warmup_steps", 0,
               "--checkpoint.enable", "--checkpoint.interval", 1, "--checkpoint.async_mode", "async",
               "--metrics.enable_tensorboard", "--spikes.max_skipped", 3)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = errors(proc)
    assert line == ("error: steps 2-4: 3 steps in a row were skipped (spikes.max_skipped = 3; the last: not finite);"
                    f" nothing was trained on them. Last good checkpoint: {tmp_path}/checkpoint/step-1")
    assert [f"skipped step {s}: not finite" in proc.stdout for s in (2, 3, 4)] == [True] * 3  # a line each
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-1"]  # the bad step never reached disk
    assert "Traceback" not in proc.stderr
    assert tensorboard_steps(tmp_path) == [1]


SECRET = "hf_notarealtoken1234567890"


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """(dump folder, finished process) of a 2-step run that saved step-2, with a Hugging Face token in its
    environment: one launch for two tests."""
    dump = tmp_path_factory.mktemp("two_steps")
    proc = run(dump, "--training.steps", 2, "--checkpoint.enable", "--checkpoint.interval", 2,
               env={"HF_TOKEN": SECRET})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return dump, proc


@pytest.mark.slow
def test_failed_save_keeps_the_previous_checkpoint(two_steps, tmp_path):
    dump = shutil.copytree(two_steps[0], tmp_path / "run")  # its step-2 is the checkpoint to keep

    def small_disk():  # a file-size limit makes every checkpoint write fail with EFBIG, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    proc = subprocess.run(cmd(dump, "--training.steps", 6, "--checkpoint.enable", "--checkpoint.interval", 2),
                          cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=small_disk)
    out = proc.stdout
    assert "checkpoint step-4 failed (" in out, out[-3000:]
    assert f"the newest complete checkpoint is still {dump}/checkpoint/step-2" in out
    assert "step: 6" in out  # training went on after the failed save at step 4
    assert proc.returncode == 3  # but the final save failed too: that is not a success
    (line,) = errors(proc)
    assert line.startswith("error: checkpoint step-6 failed")
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2"]  # intact, no .tmp leftovers
    # and the run resumes from it
    proc = run(dump, "--training.steps", 3, "--checkpoint.enable", "--checkpoint.interval", 100)
    assert proc.returncode == 0 and "resumed from" in proc.stdout


@pytest.mark.slow
def test_second_job_on_the_same_dump_folder_is_refused(tmp_path):
    # far more steps than it has time for (0.2 s each): it is killed below, after the second job's start
    first = subprocess.Popen(cmd(tmp_path, "--training.steps", 2000), cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        metrics = tmp_path / "metrics.jsonl"
        while not metrics.exists():
            assert first.poll() is None
            time.sleep(0.2)
        config_before = (tmp_path / "config.toml").read_text()
        proc = run(tmp_path, "--training.steps", 3, "--optimizer.lr", 1e-4)
        assert proc.returncode == 2
        (line,) = errors(proc)
        assert "is in use by another run" in line
        assert (tmp_path / "config.toml").read_text() == config_before  # the running job's files untouched
    finally:
        first.kill()
        first.wait()
    # the lock dies with the process that held it, even after a SIGKILL
    proc = run(tmp_path, "--training.steps", 1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_dump_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    proc = run(tmp_path / "file" / "run", "--training.steps", 1)
    assert proc.returncode == 2
    (line,) = errors(proc)
    assert "job.dump_folder" in line and "Not a directory" in line


@pytest.mark.slow
def test_tokens_never_reach_logs_configs_or_metrics(two_steps):
    dump, proc = two_steps
    written = [proc.stdout, proc.stderr] + [p.read_text() for p in dump.iterdir() if p.is_file()]
    assert not any(SECRET in text for text in written)


def test_loading_never_unpickles_and_never_runs_remote_code():
    import ast
    for name in ("train.py", "data.py", "model.py", "checkpoint_convert.py", "download_tokenizer.py"):
        source = open(os.path.join(ROOT, name)).read()
        assert "trust_remote_code" not in source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load" and \
                    getattr(node.func.value, "id", None) == "torch":
                kw = {k.arg: k.value for k in node.keywords}
                assert "weights_only" in kw and kw["weights_only"].value is True, f"{name}:{node.lineno}"


def test_an_error_exit_puts_the_async_save_in_flight_in_place(tmp_path):
    """Saver.close(), as an error exit calls it (no collective: another rank may be gone): it waits for the
    save in flight (here 0.5 s more), and rank 0 renames it into place; past save_timeout_seconds it does not."""
    import concurrent.futures
    import types

    import torch.distributed as dist

    from pretrain import checkpoint
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = types.SimpleNamespace(args=types.SimpleNamespace(params=lambda: {"dim": 8}))
        for step, timeout in ((3, 60), (4, 0.2)):
            cfg = types.SimpleNamespace(enable=True, save_timeout_seconds=timeout, folder=".")
            ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), run_keys={}, steps=9, model=model, optimizer=None,
                                           scheduler=None, loader=None, notes={}, guard=None)
            (tmp_path / f".step-{step}.tmp").mkdir()
            writing = concurrent.futures.ThreadPoolExecutor(1).submit(time.sleep, 0.5)
            ckpt.saver.pending = (writing, step, time.monotonic())
            ckpt.saver.close()
        assert sorted(os.listdir(tmp_path)) == [".step-4.tmp", "step-3"]
        assert json.loads((tmp_path / "step-3" / "params.json").read_text()) == {"dim": 8}
    finally:
        dist.destroy_process_group()


def alive(pid):
    """Running, not exited (a zombie waiting for torchrun to reap it has exited)."""
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_frozen_rank_ends_a_2x2_job_within_the_timeout_on_every_group(tmp_path):
    """SIGSTOP one rank of an FSDP 2 x TP 2 job: its TP and FSDP partners wait in the mesh's subgroups (not the
    default group), which must give up after comm.init_timeout_seconds too, each with one line, no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                             *cmd(tmp_path, "--training.steps", 500, "--training.local_batch_size", 2,
                                  "--parallelism.tensor_parallel_degree", 2, "--comm.init_timeout_seconds", 10)[1:]],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    while not metrics.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        ranks = [int(p) for p in f.read().split()]
    os.kill(ranks[3], signal.SIGSTOP)  # rank 3: TP partner of rank 2, FSDP partner of rank 1
    start, ended = time.time(), {}
    try:  # every other rank gives up (torchrun then waits for the stopped one before killing it)
        while len(ended) < 3 and time.time() - start < 120:
            ended.update({r: time.time() - start for r in range(3) if r not in ended and not alive(ranks[r])})
            time.sleep(0.2)
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
    out = proc.stdout.read()
    print(f"seconds after the SIGSTOP until each other rank ended: {ended}")
    assert len(ended) == 3 and max(ended.values()) < 45, (ended, out[-3000:])  # 10 s plus the step it hit, not 30 min
    lines = re.findall(r"error: rank (\d): a collective in \w+ \([\w/]+\.py:\d+\) (waited 10 s|lost its connection)", out)
    assert {r for r, _ in lines} == {"0", "1", "2"} and len(lines) == 3, out[-3000:]
    assert 'train.py", line' not in out and proc.returncode != 0  # no rank's traceback (torchrun prints its own)


@pytest.mark.slow
def test_a_failed_commit_and_the_step_to_resume_reach_every_rank(tmp_path):
    """Rank 0 alone puts a checkpoint in place, and lists the folder on resume: every rank must learn both. One
    launch of this file as a script, two runs: stale files at step-4 and step-6 (as NFS leaves them) make those
    commits fail: step 4's is logged and training goes on, step 6's (the last) ends both ranks with the same line.
    Then rank 1's listing shows no checkpoint and step-2 incomplete (a stale NFS cache): both resume from rank 0's
    step-2, exactly."""
    (tmp_path / "checkpoint").mkdir()
    for stale in ("step-4", "step-6"):
        (tmp_path / "checkpoint" / stale).write_text("stale")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, "two_runs", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("checkpoint step-4 failed (OSError: putting it in place: NotADirectoryError") == 2, out[-3000:]
    ends = re.findall(r"run 1 rank \d: (checkpoint step-6 failed .*)", out)
    assert len(ends) == 2 and ends[0] == ends[1] and ends[0].endswith(f"still {tmp_path}/checkpoint/step-2"), out
    assert f"resumed from {tmp_path}/checkpoint/step-2 at step 2" in out
    records = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl") if '"loss"' in ln]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert [r["loss"] for r in records[6:]] == [r["loss"] for r in records[2:6]]  # bitwise


def two_runs(dump: str):
    """The script side of the test above, on each rank of a 2-process torchrun."""
    import torch.distributed as dist

    from pretrain import checkpoint_folder
    import train
    rank, args = int(os.environ["RANK"]), cmd(dump, "--training.steps", 6, "--checkpoint.enable", "--checkpoint.interval",
                                              2, "--training.local_batch_size", 4, "--comm.init_timeout_seconds", 30)[2:]
    try:
        train.main(train.load_config(args))
    except checkpoint_folder.SaveError as e:
        print(f"run 1 rank {rank}: {e}", flush=True)
        dist.destroy_process_group()
    if rank == 0:
        for stale in ("step-4", "step-6"):
            os.remove(os.path.join(dump, "checkpoint", stale))
    else:
        checkpoint_folder.checkpoints = lambda folder, warn=False: []  # rank 1's listing: nothing there
        checkpoint_folder.incomplete = lambda path: "stale attributes"  # and its view of step-2: cut short
    # torchrun's store keeps the first run's keys: a store of its own for the second run
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + 1))
    train.main(train.load_config(args))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_save_that_failed_on_one_rank_only_fails_on_both_and_the_next_one_works(tmp_path, mode):
    """Rank 1's save raises after DCP's last collective (its gloo timed out there), rank 0's went well: both must
    count it failed, and both make the new save group (dist.new_group is a collective), so the next save is in
    place on both, not a hang or a mismatched collective until the timeout."""
    proc = run_training(["one_rank_save_fails", str(tmp_path), mode], nproc=2, program="tests/test_robustness.py",
                        timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    failed = re.findall(r"rank (\d): checkpoint step-1 failed \(RuntimeError: Timed out waiting .*\); the newest "
                        r"complete checkpoint is still none", out)
    assert sorted(failed) == ["0", "1"], out[-3000:]
    assert sorted(re.findall(r"rank (\d): saved checkpoint \S+/step-2", out)) == ["0", "1"], out[-3000:]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]


def one_rank_save_fails(dump: str, mode: str):
    """The script side of the test above, on each rank of 2."""
    import logging
    import types
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pretrain import checkpoint_folder
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s", stream=sys.stdout, force=True)
    cfg = types.SimpleNamespace(enable=True, save_timeout_seconds=10, async_mode=mode, keep_latest_k=0)
    saver = checkpoint_folder.Saver(cfg, os.path.join(dump, "checkpoint"), lambda: {"dim": 8})
    dcp = checkpoint_folder.dcp
    saves = {"disabled": dcp.save, "async": dcp.async_save}

    def save_then_time_out(*args, **kwargs):
        saves[mode](*args, **kwargs)
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")

    setattr(dcp, saves[mode].__name__, save_then_time_out if rank == 1 else saves[mode])
    saver.save(1, lambda: {"w": torch.full((4,), 1.0)}, final=False)
    setattr(dcp, saves[mode].__name__, saves[mode])
    saver.save(2, lambda: {"w": torch.full((4,), 2.0)}, final=False)
    if saver.pending is not None:
        saver.finish()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_data_error_on_one_rank_ends_every_rank_with_the_same_line(tmp_path):
    """Stream 1's C4 file is cut off mid-way: only the rank reading it fails, several steps in, inside a
    gradient accumulation (the failing micro-batch is not the step's last); both ranks must end with that
    one line and exit 2, not one line and a gloo traceback."""
    import gzip
    src = tmp_path / "c4"
    shutil.copytree(os.path.join(ROOT, "assets", "data", "c4"), src)
    files = sorted((src / "en").glob("c4-train.*.json.gz"))
    data = gzip.decompress(files[1].read_bytes())
    # cut off after a few documents: rank 0 fails at step 9, on the 2nd of its 4 micro-batches
    files[1].write_bytes(gzip.compress(data)[:len(gzip.compress(data)) // 40])
    toml = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    toml = toml.replace('path = "assets/data/c4"', f'path = "{src}"')
    (tmp_path / "c.toml").write_text(toml)
    start = time.time()
    # SMALL's 2 blocks at the config's seq 256: the micro-batch that meets the cut follows the sequence length
    # torchrun itself: the test reads its report
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", "--config", str(tmp_path / "c.toml"), "--job.dump_folder", str(tmp_path / "d"),
                           "--metrics.log_freq", "1", "--validation.enable", "false", "--training.steps", "40", "--training.local_batch_size", "1",
                           "--training.global_batch_size", "8", "--model.n_layers", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    # Both ranks print the same line (to one stderr, so the two may share a line of the terminal).
    lines = re.findall(r"error: (data source 'c4': reading \S+ at row \d+ failed[^\n]*?reached\))", proc.stderr)
    assert proc.returncode != 0 and len(lines) == 2 and lines[0] == lines[1], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert files[1].name in lines[0]
    assert "step: 2" in proc.stdout  # found inside the loop, not at start-up
    assert "exitcode  : 2" in proc.stderr  # torchrun's report (it may stop the second rank before it exits)
    assert 'train.py", line' not in proc.stderr and "Connection closed" not in proc.stderr  # no rank's traceback
    assert time.time() - start < 120


def loader_worker(pid: int):
    """The loader worker of the train.py process `pid`: its child that multiprocessing spawned (not its resource
    tracker), else None."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as g:
                        if b"spawn_main" in g.read():
                            return child
                except OSError:  # it ended meanwhile
                    pass
    return None


@pytest.mark.slow
@pytest.mark.parametrize("queued", [False, True])
def test_a_killed_loader_worker_is_its_nodes_fault_and_never_hangs_the_rank(tmp_path, queued):
    """SIGKILL to the one loader worker, as the out-of-memory killer sends it. At once (its queues empty): exit 4 and
    one line within seconds, so Slurm restarts the job (it was exit 2, a user error, which it never restarts). After
    step 1 (its queues hold documents, C4's pipe half of one: each is larger than a pipe): the rank trains on what
    came whole and ends, cleanly or with that line. It hung for good in the loader's close(), SIGTERM ignored."""
    rng = random.Random(0)
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "docs.jsonl", "w") as f:
        for _ in range(4):  # about 40,000 tokens each, 103 KB as a message
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(10**6)}" for _ in range(8000))}) + "\n")
    toml = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    c4 = 'path = "assets/data/c4"\ndata_files = "en/c4-train.*.json.gz"'
    (tmp_path / "c.toml").write_text(toml.replace(c4, f'path = "{tmp_path / "big"}"\ndata_files = "*.jsonl"'))
    # --phases none: the debug config's phase at step 31 (sequences 8 times SMALL's) would make the bound below
    # measure training rather than the loader's close
    launch = cmd(tmp_path / "d", "--training.steps", 60, "--data.num_workers", 1, "--phases", "none")
    launch[launch.index("configs/debug_model.toml")] = str(tmp_path / "c.toml")
    proc = subprocess.Popen(launch, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while (worker := loader_worker(proc.pid)) is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert worker, "train.py started no loader worker"
        if queued:  # after step 1, when the worker has read ahead
            metrics = tmp_path / "d" / "metrics.jsonl"
            while not (metrics.exists() and b'"loss"' in metrics.read_bytes()) and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(0.2)
        os.kill(worker, signal.SIGKILL)
        killed = time.time()
        out, err = proc.communicate(timeout=120)  # the hang was for good: room for the steps on a slow machine
    except subprocess.TimeoutExpired:
        pytest.fail("the rank was still running 120 s after its loader worker was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [ln for ln in (out + err).splitlines() if ln.startswith("error:")]
    died = f"error: data loader worker {worker} died (killed by SIGKILL: out of memory?)"
    if queued and proc.returncode == 0:  # it trained to the end on what came whole
        assert lines == [] and "done: step 60" in out + err
    else:
        assert (proc.returncode, lines) == (4, [died]), out[-2000:] + err[-2000:]
    assert "Traceback" not in err
    assert queued or time.time() - killed < 10  # not after a read's 5 s wait


@pytest.mark.slow
def test_slow_reads_and_slow_writers_are_waited_for_as_long_as_they_may_take(slow_runs_launch):
    """Waits bounded by what they wait on, not by comm.init_timeout_seconds (6 s here). One launch, three runs (see
    slow_runs): A, a rank reads or writes 8 s behind the other (its first documents, rank 0's held-out and eval reading
    alone, an async save, the last save): the run finishes with both checkpoints. C, a write 20 s long, past
    checkpoint.save_timeout_seconds: that save fails on both ranks with one line, training goes on and the next
    save works. B, rank 0's reading past data.resolve_timeout_seconds: rank 1's line says what rank 0 was doing."""
    proc, tmp_path, output = slow_runs_launch
    proc.wait(timeout=300)
    out = output.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert re.findall(r"run A rank (\d): finished", out) in (["0", "1"], ["1", "0"]), out[-3000:]
    assert f"saved checkpoint {tmp_path}/A/checkpoint/step-2 (async)" in out
    assert sorted(os.listdir(tmp_path / "A" / "checkpoint")) == ["step-2", "step-4"]
    # rank 1 writes for 20 s; on a loaded machine rank 0's own write may also outlast the 3 s and be named instead
    failed = r"checkpoint step-2 failed \(rank [01] was still writing after checkpoint.save_timeout_seconds = 3 s\)"
    assert len(re.findall(failed, out)) == 2 and "run C rank 1: finished" in out, out[-3000:]
    assert sorted(os.listdir(tmp_path / "C" / "checkpoint")) == ["step-4"]
    assert ("run B rank 1: rank 1 waited data.resolve_timeout_seconds = 3 s for rank 0 to read the held-out windows "
            "and eval tasks alone, and it was still reading the held-out windows of 'c4'") in out, out[-3000:]


def slow(owner, name: str, seconds):
    """owner.name made seconds(its arguments) slower."""
    original = getattr(owner, name)

    def slower(*args, **kwargs):
        time.sleep(seconds(*args))
        return original(*args, **kwargs)

    setattr(owner, name, slower)


def slow_runs(dump: str):
    """The script side of the test above, on each rank of a 2-process torchrun: runs A, C, then B (which fails)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import data
    from pretrain import evals
    import train
    rank, port, now = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]), {"run": "A", "saves": {}}
    slow(data.DataLoader, "check", lambda *args: 8 * (rank == 1 and now["run"] == "A"))  # its first documents
    slow(evals, "load", lambda *args: 8 * (rank == 0 and now["run"] == "A"))  # eval tasks: rank 0 reads alone
    slow(evals, "heldout_windows", lambda src, *args: 8 * (rank == 0 and now["run"] == "B" and src.name == "c4"))
    slow(FileSystemWriter, "write_data", lambda writer, *args: now["saves"].get(writer.path.name, 0) * (rank == 1))
    args = ["--training.steps", 4, "--checkpoint.enable", "--checkpoint.interval", 2, "--checkpoint.async_mode", "async",
            "--training.local_batch_size", 4, "--comm.init_timeout_seconds", 6]
    for run, saves, extra in (("A", {".step-2.tmp": 8, ".step-4.tmp": 8}, []),
                              ("C", {".step-2.tmp": 20}, ["--checkpoint.save_timeout_seconds", 3]),
                              ("B", {}, ["--data.resolve_timeout_seconds", 3, "--validation.enable", "true"])):
        now.update(run=run, saves=saves)
        if run != "A":  # torchrun's store keeps the first run's keys: a store of its own
            os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(port + "ACB".index(run)))
        try:
            train.main(train.load_config(cmd(os.path.join(dump, run), *args, *extra)[2:]))
            print(f"run {run} rank {rank}: finished", flush=True)
        except Exception as e:
            print(f"run {run} rank {rank}: {e}", flush=True)
            dist.destroy_process_group()


# What a rank's exception says when its peer ended, word for word, and what lost_rank makes of it: one line that
# slurm/recover.py reads as a lost peer (this rank is not the one to blame), not a bug's traceback and exit 1.
GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
REMOTE = ("remote process exited or there was a network error, NCCL version {}\nncclRemoteError: A call failed "
          "possibly due to a network error or a remote process exiting prematurely.\nLast error:\n{}")
WATCHDOG = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, "
            "NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.")
LOST = {
    # torch 2.13.0+cpu here, a 2-process gloo group: the peer SIGKILLed, or exited, in a collective
    "gloo closed": ("RuntimeError", GLOO + "pair.cc:553] Connection closed by peer [127.0.0.1]:23976. This is "
                    "typically caused by a remote worker crashing. Check the logs of the remote worker before "
                    "reporting an error. GLHF! 🏖️", "(Connection closed by peer)"),
    # ... the peer alive but not joining within the group's timeout (5 s)
    "gloo timeout": ("RuntimeError", GLOO + "unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to "
                     "complete", "waited 5 s"),
    # ... a new group on keys an earlier attempt left in the store (docs/slurm.md: a restarted attempt): the dead
    # peer's address; which of the two a rank sees depends on which side connects
    "gloo refused": ("RuntimeError", "Gloo connectFullMesh failed with " + GLOO + "pair.cc:152] timed out "
                     "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:55702$0", "(Connection refused)"),
    "gloo never connected": ("RuntimeError", "Gloo connectFullMesh failed with " + GLOO + "pair.h:311] Connect "
                             "timeout [none]", "(Connect timeout)"),
    # ... c10d's TCPStore client when the store's host (torchrun's agent on the first node, or rank 0) is gone
    "store write": ("DistNetworkError", "Broken pipe", "(Broken pipe)"),
    "store wait": ("DistNetworkError", "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
                   "server shutdown or crash?", "(Failed to recv)"),
    # gloo's source (pytorch/gloo main, tcp/pair.cc: Pair::read, verifyConnected, Pair::write in sync mode; the
    # words are in torch 2.13's libtorch_cpu.so); GLOO_ERROR_MSG puts "[file:line] " before each
    "gloo reset": ("RuntimeError", "Read error [127.0.0.1]:41234: Connection reset by peer. This is typically "
                   "caused by a remote worker hanging or bugs in the application. Check the logs of the remote "
                   "worker before reporting an error. GLHF! 🏖️", "(Connection reset by peer)"),
    "gloo socket closed": ("RuntimeError", "Socket closed [127.0.0.1]:41234", "(Socket closed)"),
    "gloo writev": ("RuntimeError", "writev [127.0.0.1]:41234: Broken pipe", "(Broken pipe)"),
    # NCCL as a collective raises it (C10D_NCCL_CHECK in torch's NCCLUtils.hpp, the same in torch 2.13's shipped
    # header): logs in NVIDIA/nccl#2076 (NCCL 2.21.5) and #1928 (NCCL 2.28.8, torch 2.11's)
    "nccl reset": ("DistBackendError", "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, "
                   + REMOTE.format("2.21.5", "socketProgressOpt: Call to recv from 172....<33759> failed : "
                                   "Connection reset by peer"), "(ncclRemoteError)"),
    "nccl network": ("DistBackendError", "NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
                     "ProcessGroupNCCL.cpp:3763, " + REMOTE.format("2.28.8", "NET/OFI Request 0x7f14cc5b60c0 "
                     "completed with error. RC: 113. Error: 2 (UNDELIVERABLE). Completed length: 0"),
                     "(ncclRemoteError)"),
    # ... NCCL's socket transport before it had ncclRemoteError (NVIDIA/nccl#1514: internal error, NCCL 2.14.3)
    "nccl closed": ("DistBackendError", "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, "
                    "internal error, NCCL version 2.14.3\nncclInternalError: Internal check failed.\nLast error:\n"
                    "Net : Connection closed by remote peer user<50260>", "(Connection closed by remote peer)"),
    # the watchdog's timeout (its log line in XPixelGroup/BasicSR#737, PG GUID era), as a blocking wait raises
    # it, and as a call on the communicator it aborted then raises (NCCLComm::getNcclComm, NCCLUtils.cpp)
    "nccl watchdog": ("DistBackendError", WATCHDOG, "waited 600 s"),
    "nccl aborted": ("DistBackendError", "NCCL communicator was aborted on rank 1.  Original reason for failure "
                     "was: " + WATCHDOG, "waited 600 s"),
}
NOT_LOST = {  # a bug or a user's error: its traceback
    "cuda": ("RuntimeError", "CUDA error: an illegal memory access was encountered"),
    # NVIDIA/nccl#1241 (NCCL 2.17.1), its first two lines
    "nccl usage": ("DistBackendError", "NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
                   "ProcessGroupNCCL.cpp:1287, invalid usage, NCCL version 2.17.1\nncclInvalidUsage: This usually "
                   "reflects invalid usage of NCCL library."),
    "a closed pipe": ("BrokenPipeError", 32, "Broken pipe"),  # an OSError: printing to a reader that left
}


def exception(kind: str, *args) -> BaseException:
    """torch.distributed's exception class of that name (a RuntimeError each), else Python's."""
    import builtins

    import torch.distributed as dist
    return (getattr(dist, kind, None) or getattr(builtins, kind))(*args)


@pytest.mark.parametrize("case", sorted(LOST))
def test_a_peer_that_ended_is_a_lost_rank_not_a_traceback(case):
    """Each backend's words for a peer that ended: one line that names what broke, which train.py prints before
    exit 3 (restarted by slurm/multinode.sbatch) and slurm/recover.py does not blame on this rank's node."""
    sys.path.insert(0, ROOT)
    from pretrain import faults
    kind, text, what = LOST[case]
    line = faults.lost_rank(exception(kind, text))
    assert "\n" not in line and what in line, line
    lost = ("lost its connection to another rank", "for a rank that never joined it")  # slurm/recover.py's LOST
    assert any(words in line for words in lost), line


@pytest.mark.parametrize("case", sorted(NOT_LOST))
def test_anything_else_keeps_its_traceback(case):
    sys.path.insert(0, ROOT)
    from pretrain import faults
    assert faults.lost_rank(exception(*NOT_LOST[case])) == ""


def signals_in_a_handler(out: str):
    """A second preemption signal arrives while the first one's handler runs, at each line it runs, in Python
    and below it (sys.settrace sends it): Slurm's USR1 to every process, then the launcher's death (SIGTERM
    through PR_SET_PDEATHSIG). Writes how many signals the flag saw."""
    from pretrain import distributed
    stop = distributed.stop_on_signals()
    sent = []

    def trace(frame, event, arg):
        inside = sent or frame.f_code.co_name == "<lambda>"  # the handler, and what it calls
        if event == "line" and inside and len(sent) < 5:
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next instruction, inside this handler
        return trace if inside else None

    sys.settrace(trace)
    os.kill(os.getpid(), signal.SIGUSR1)
    sys.settrace(None)
    with open(out, "w") as f:
        f.write(f"{len(stop)} {len(sent)}")


def test_a_second_signal_inside_the_first_handler_does_not_hang_the_rank(tmp_path):
    """threading.Event.set() takes a lock: a second signal handled while the first handler holds it waited on
    that lock forever (a rank of the preemption test, found frozen in its handler). The flag takes none."""
    out = tmp_path / "seen"
    proc = run_training([out], program=__file__, env={"CHECK": "signals_in_a_handler"}, timeout=20)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen, sent = map(int, out.read_text().split())
    assert sent >= 1 and seen == 1 + sent  # every signal seen, none lost


if __name__ == "__main__":
    if os.environ.get("CHECK"):
        globals()[os.environ["CHECK"]](sys.argv[1])
    else:
        scripts = {"two_runs": two_runs, "slow_runs": slow_runs, "one_rank_save_fails": one_rank_save_fails}
        scripts[sys.argv[1]](*sys.argv[2:])
