"""Checkpointing in train.py: exact resume after SIGKILL and SIGTERM (FSDP and TP), async saves,
keep_latest_k, the model-only export, initial_load_path and refused resumes. CPU, gloo.

Runs train conftest.SMALL (2 blocks, seq 64) unless a test needs the flavor's depth; several tests
share one launch through a module fixture (a launch costs ~5 s of imports before its first step)."""

import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, run_training, titan_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP = ("--training.local_batch_size", 4)  # 2 ranks x 4 = the debug config's global batch of 8
# six_steps keeps the flavor's 6 blocks (test_changed_config_refuses_to_resume names that depth)
SEQ_64 = ("--training.seq_len", 64)


def train_args(dump, *args):
    return ["--config", "configs/debug_model.toml", "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
            "--validation.enable", "false", "--training.steps", "10", "--checkpoint.enable", *map(str, args)]


def launch(dump, *args):
    """train.py on 2 ranks under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *train_args(dump, *args)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(dump, *args, nproc=2, expect=0):
    """train.py's output on nproc ranks, forked as under torchrun (conftest.run_training); launch() is torchrun
    itself, for the tests that signal its ranks."""
    proc = run_training(train_args(dump, *args), nproc)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect, out[-3000:]
    return out


def wait_for_step(proc, dump, step):
    """Until this launch (not an earlier one appending to the same file) has logged `step`."""
    metrics = os.path.join(dump, "metrics.jsonl")
    seen = open(metrics).read().count("\n") if os.path.exists(metrics) else 0
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if os.path.exists(metrics):
            new = [json.loads(line) for line in open(metrics).read().splitlines()[seen:]]
            if any(r["step"] >= step for r in new):
                return
        time.sleep(0.1)


def logged(dump):
    """Loss per step; after a restart the re-run steps overwrite the earlier ones."""
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}  # not validation rounds


def stop_ranks(proc, sig):
    """Signal the ranks themselves (torchrun puts each in its own session)."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        for pid in map(int, f.read().split()):
            os.kill(pid, sig)


def steps_saved(dump):
    return sorted(int(d.split("-")[1]) for d in os.listdir(os.path.join(dump, "checkpoint")) if d.startswith("step-"))


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A finished 1-process run of 6 steps with checkpoints at 2, 4 and 6, at the flavor's depth and
    seq 64: tests resume copies of it."""
    dump = tmp_path_factory.mktemp("six_steps")
    run(dump, *SEQ_64, "--training.steps", 6, "--checkpoint.interval", 2, nproc=1)
    return dump


def copy_of(dump, tmp_path):
    return shutil.copytree(dump, tmp_path / "run")


@pytest.fixture(scope="module")
def reference(fsdp_reference, tp_reference):
    """Losses of the uninterrupted 10-step runs (conftest.py): FSDP over 2 ranks, and TP=2."""
    return {"fsdp": logged(fsdp_reference[0]), "tp": logged(tp_reference[0])}


@pytest.fixture(scope="module")
def stopped_twice(tmp_path_factory):
    """A 2-rank FSDP run (checkpoints every 3 steps) SIGKILLed after step-3, restarted, and stopped by
    SIGTERM (which saves the step it stops at): two tests finish copies of it, on 2 ranks and on 1."""
    dump = tmp_path_factory.mktemp("stopped_twice")
    args = (*FSDP, *SMALL, "--checkpoint.interval", 3)
    proc = launch(dump, *args)
    wait_for_step(proc, dump, 4)  # step-3 is complete by now
    stop_ranks(proc, signal.SIGKILL)  # no chance to save anything; torchrun then ends too
    assert proc.wait() != 0, "the run ended before the SIGKILL"
    # At 0.3 s a step, a loaded machine may deliver the kill after step-6's save too: either will do.
    assert steps_saved(dump)[0] == 3
    os.makedirs(dump / "checkpoint" / ".step-99.tmp")  # what a crash in the middle of a save leaves

    proc = launch(dump, *args)  # restart 1: resumes from the newest step-N, ignoring the .tmp folder
    wait_for_step(proc, dump, 4)  # its first step: the SIGTERM comes well before step 10
    stop_ranks(proc, signal.SIGTERM)  # restart 2 will come from the step it stopped at
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "resumed from" in out and "stopping at step" in out, out[-3000:]
    assert not os.path.exists(dump / "checkpoint" / ".step-99.tmp")  # cleaned by the next save
    return dump


@pytest.mark.slow
def test_fsdp_sigkill_then_sigterm_then_finish_is_bitwise_exact(stopped_twice, reference, tmp_path):
    dump = copy_of(stopped_twice, tmp_path)
    stopped_at = steps_saved(dump)[-1]
    out = run(dump, *FSDP, *SMALL, "--checkpoint.interval", 3)
    assert f"resumed from {dump}/checkpoint/step-{stopped_at}" in out
    assert logged(dump) == reference["fsdp"]


@pytest.mark.slow
def test_tp_resume_with_loader_workers_is_bitwise_exact(reference, tmp_path):
    # The reference ran without loader workers: workers change neither the stream nor what a resume
    # continues from. Workers that read ahead make the save; the resume is without them (each worker
    # imports for seconds; test_preemption_signal_... resumes into workers).
    args = ("--parallelism.tensor_parallel_degree", 2, "--activation_checkpoint.mode", "selective",
            "--checkpoint.interval", 100, *SMALL)
    proc = launch(tmp_path, *args, "--data.num_workers", 2)
    wait_for_step(proc, tmp_path, 3)  # steps 4-10 take seconds: the signal comes before the end
    stop_ranks(proc, signal.SIGUSR1)
    assert proc.wait(timeout=300) == 0
    run(tmp_path, *args)
    assert logged(tmp_path) == reference["tp"]


@pytest.mark.slow
def test_resume_on_one_process_continues_the_same_stream(stopped_twice, reference, tmp_path):
    """Data state is per logical stream, so a 2-rank run can resume on 1 rank (same num_streams)."""
    dump = copy_of(stopped_twice, tmp_path)
    stopped_at = steps_saved(dump)[-1]
    out = run(dump, "--checkpoint.interval", 100, *SMALL, nproc=1)
    assert f"resumed from {dump}/checkpoint/step-{stopped_at}" in out
    for step, loss in logged(dump).items():
        assert loss == pytest.approx(reference["fsdp"][step], rel=1e-5)


@pytest.mark.slow
def test_async_save_keep_latest_and_model_only_export(tmp_path):
    args = ("--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", 2,
            "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16", *SMALL)
    out = run(tmp_path, "--checkpoint.interval", 2, *args, nproc=1)
    assert "(async)" in out and "training blocked" in out
    assert steps_saved(tmp_path) == [8, 10]  # keep_latest_k = 2
    final = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-10")).read_metadata().state_dict_metadata
    # 9 tensors in each of SMALL's 2 blocks, the embeddings, the final norm and output; train's config
    assert {k.split(".")[0] for k in final} == {"model", "train"} and len(final) == 9 * 2 + 3 + 1
    assert final["model.output.weight"].properties.dtype == torch.bfloat16
    assert json.load(open(tmp_path / "checkpoint" / "step-10" / "params.json"))["dim"] == 256

    # The async step-8 is a full checkpoint: resuming from it replays steps 9-10 exactly.
    first = logged(tmp_path)
    out = run(tmp_path, "--checkpoint.load_step", 8, "--checkpoint.interval", 100, *args, nproc=1)
    assert logged(tmp_path) == first
    # The finished run's newest checkpoint is the export: a restart has nothing to do.
    out = run(tmp_path, *SMALL, nproc=1)
    assert "final export of a finished run" in out

    # A new run can start from the exported weights.
    out = run(tmp_path / "new", "--checkpoint.initial_load_path", tmp_path / "checkpoint" / "step-10",
              "--training.steps", 2, "--checkpoint.interval", 100, *SMALL, nproc=1)
    assert "loaded weights from" in out
    assert logged(tmp_path / "new")[1] < first[1] - 2  # starts from trained weights


@pytest.fixture(scope="module")
def refused(six_steps, tmp_path_factory):
    """(dump, output) of one resume of a copy of six_steps that changes three things a resume must not:
    the sequence length, the depth and the tokenizer (its size, two ids swapped). One line names all."""
    tmp = tmp_path_factory.mktemp("refused")
    swapped = write_tokenizer(tmp / "swapped.model", 1792, swap=True)
    dump = shutil.copytree(six_steps, tmp / "run")
    out = run(dump, "--training.steps", 8, "--training.seq_len", 128, "--model.n_layers", 4,
              "--model.tokenizer_path", swapped, nproc=1, expect=2)
    return dump, out


@pytest.fixture(scope="module")
def resumed(six_steps, tmp_path_factory):
    """(dump, output, output) of two restarts of a copy of six_steps: at training.steps 6, then at 8
    naming the flavor's depth, 6."""
    dump = shutil.copytree(six_steps, tmp_path_factory.mktemp("resumed") / "run")
    at_six = run(dump, *SEQ_64, "--training.steps", 6, nproc=1)
    at_eight = run(dump, *SEQ_64, "--training.steps", 8, "--model.n_layers", 6, nproc=1)
    return dump, at_six, at_eight


@pytest.mark.slow
def test_changed_config_refuses_to_resume(refused, resumed):
    dump, out = refused
    assert "refusing to resume" in out and "training.seq_len: 64 -> 128" in out
    # Fewer layers would load the first blocks of a deeper checkpoint silently: refused too.
    assert "model.n_layers: 6 -> 4" in out
    assert steps_saved(dump) == [2, 4, 6]
    # Naming the flavor's own depth is no change: it resumes (and reports the measured memory peak).
    dump, _, out = resumed
    assert "at step 6" in out and steps_saved(dump) == [2, 4, 6, 8]
    assert re.search(r"memory: peak [\d.]+ GiB RSS$", out, re.M), out


@pytest.mark.slow
def test_initial_load_path_errors_are_one_line(tmp_path):
    out = run(tmp_path / "a", "--checkpoint.initial_load_path", tmp_path / "nothing", nproc=1, expect=2)
    assert "is not a complete DCP checkpoint" in out
    wrong = {"model.tok_embeddings.weight": torch.zeros(100, 256), "model.norm.weight": torch.ones(256)}
    dcp.save(wrong, checkpoint_id=str(tmp_path / "wrong"), no_dist=True)
    out = run(tmp_path / "b", "--checkpoint.initial_load_path", tmp_path / "wrong", nproc=1, expect=2)
    line = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "model.tok_embeddings.weight (100, 256) vs ours (2048, 256)" in line[0]
    assert "model.layers.0.attention.wq.weight missing" in line[0] and "(and 51 more)" in line[0]


@pytest.mark.slow
def test_initial_load_from_converted_meta_weights(tmp_path):
    """Meta-format weights -> checkpoint_convert.py torch2dcp -> train.py starts from exactly them."""
    sys.path.insert(0, ROOT)
    import torch.nn.functional as F
    import checkpoint_convert
    import train
    from data import DataLoader, Tokenizer
    from model import Transformer, flavors

    torch.manual_seed(7)
    small = dataclasses.replace(flavors["debugmodel"], n_layers=2)  # conftest.SMALL's depth
    model = Transformer(small)
    model.init_weights()
    meta = tmp_path / "meta"
    meta.mkdir()
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, meta / "consolidated.00.pth")
    params = {k: getattr(small, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
              "vocab_size", "multiple_of", "ffn_dim_multiplier", "norm_eps", "rope_theta", "use_scaled_rope")}
    (meta / "params.json").write_text(json.dumps(params))
    # in this process: the command line is tested in tests/test_convert.py
    checkpoint_convert.main(["torch2dcp", "--input_dir", str(meta), "--output_dir", str(tmp_path / "dcp")])
    out = run(tmp_path / "run", "--checkpoint.initial_load_path", tmp_path / "dcp", "--training.steps", 1,
              *SMALL, nproc=1)
    assert "loaded weights from" in out

    # The logged step-1 loss is the converted (bf16-rounded) weights' loss on the first global batch.
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml")])
    cfg.data.sources = [dataclasses.replace(s, path=os.path.join(ROOT, s.path)) for s in cfg.data.sources]
    tokenizer = Tokenizer(os.path.join(ROOT, cfg.model.tokenizer_path))
    loader = DataLoader(cfg.data.sources, tokenizer, 64, 8, 0, 1, num_streams=2, seed=cfg.data.seed)  # SMALL's seq 64
    inputs, labels = next(loader)
    loader.close()
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert logged(tmp_path / "run")[1] == pytest.approx(expected, rel=1e-5)


def write_tokenizer(path, n_ranks, swap=False):
    """A tiktoken file: the bundled ranks, then made-up two-byte tokens up to n_ranks (or two ranks swapped)."""
    lines = open(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")).read().split("\n")
    lines = [ln for ln in lines if ln.strip()]
    have = {ln.split()[0] for ln in lines}
    import base64
    extra = (base64.b64encode(bytes([a, b])).decode() for a in range(32, 127) for b in range(256))
    while len(lines) < n_ranks:
        tok = next(extra)
        if tok not in have:
            lines.append(f"{tok} {len(lines)}")
    if swap:  # same size, other ids for two tokens
        (a, ra), (b, rb) = lines[300].split(), lines[301].split()
        lines[300], lines[301] = f"{a} {rb}", f"{b} {ra}"
    path.write_text("\n".join(lines[:n_ranks]) + "\n")
    return path


@pytest.mark.slow
def test_vocab_follows_the_tokenizer_and_another_tokenizer_is_refused_on_resume(refused, tmp_path):
    big = write_tokenizer(tmp_path / "big.model", 6000)  # 6,000 ranks + 256 special tokens
    out = run(tmp_path / "big", "--model.tokenizer_path", big, "--training.steps", 2, *SMALL, nproc=1)
    assert "vocab 6,256" in out
    meta = dcp.FileSystemReader(str(tmp_path / "big" / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    assert tuple(meta["model.tok_embeddings.weight"].size) == (6256, 256)
    assert json.load(open(tmp_path / "big" / "checkpoint" / "step-2" / "params.json"))["vocab_size"] == 6256

    # the same size, two ids swapped: refused (with the other changes of the shared launch, in one line)
    line = [ln for ln in refused[1].splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "refusing to resume" in line[0] and "model.tokenizer_sha256" in line[0]
    assert "checkpoint.initial_load_path" in line[0]


@pytest.mark.slow
def test_incomplete_checkpoints_are_skipped_and_refused_by_name(six_steps, tmp_path):
    dump = copy_of(six_steps, tmp_path)
    ckpt = dump / "checkpoint"
    os.remove(ckpt / "step-6" / ".metadata")  # a copy cut short, or a non-atomic rename
    shard = next(p for p in (ckpt / "step-4").iterdir() if p.name.endswith(".distcp"))
    with open(shard, "r+b") as f:  # a disk that filled during a copy
        f.truncate(os.path.getsize(shard) // 2)
    out = run(dump, *SEQ_64, "--training.steps", 3, "--checkpoint.interval", 100, nproc=1)  # one step will do
    assert "skipping incomplete checkpoint step-6" in out and ".metadata is missing or unreadable" in out
    assert f"skipping incomplete checkpoint step-4: {shard} is" in out and "the metadata needs" in out
    assert f"resumed from {ckpt}/step-2 at step 2" in out and "Traceback" not in out

    for step, why in ((4, "the metadata needs"), (6, ".metadata is missing")):
        out = run(dump, "--checkpoint.load_step", step, nproc=1, expect=2)
        line = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert len(line) == 1 and f"checkpoint.load_step = {step}" in line[0] and why in line[0], out[-2000:]
        assert "Traceback" not in out
    # Garbage of the right length passes the check; what dcp.load then raises is still one line.
    shard = next(p for p in (ckpt / "step-2").iterdir() if p.name.endswith(".distcp"))
    shard.write_bytes(b"\x00" * os.path.getsize(shard))
    out = run(dump, "--checkpoint.load_step", 2, nproc=1, expect=2)
    line = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and f"cannot load {ckpt}/step-2" in line[0] and "Traceback" not in out, out[-2000:]


@pytest.mark.slow
def test_resume_says_when_the_schedule_changes_and_when_nothing_is_left(resumed):
    _, at_six, at_eight = resumed
    assert "nothing left to do" in at_six and "step: " not in at_six
    assert "training.steps changed 6 -> 8: the lr schedule now ends at step 8" in at_eight


def descendants(pid):
    """Every process below pid (ranks, their loader workers), depth first."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{tid}/children").read().split()
        except FileNotFoundError:
            continue
        for kid in map(int, kids):
            out += [kid] + descendants(kid)
    return out


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_preemption_signal_saves_and_ends_the_job_however_it_is_delivered(reference, tmp_path):
    """One run stopped three times, each time delivered another way, and resumed: SIGUSR1 to both ranks;
    SIGTERM to torchrun alone; SIGUSR1 to every process of the job, loader workers included (Slurm's
    --signal=USR1 without B:), which kills torchrun itself. Each time it saves and every process is gone
    within 30 s by itself; the four launches together log the uninterrupted run's losses, bit for bit. Loader
    workers (which a resume may add or drop) only where the signal reaches them: they cost seconds to start. With
    last_save_model_only, as only the last step's save is the weights-only export."""
    # a signal's save: whole
    args = (*FSDP, *SMALL, "--checkpoint.interval", 100, "--checkpoint.last_save_model_only", "true")
    stopped = 0
    for delivery in ("ranks", "launcher", "every process"):
        workers = 2 if delivery == "every process" else 0
        proc = launch(tmp_path, *args, "--data.num_workers", workers)
        wait_for_step(proc, tmp_path, stopped + 1)
        ranks = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        job = [proc.pid] + descendants(proc.pid)
        assert len(job) >= 2 + 1 + 2 * workers  # torchrun, 2 ranks, their workers (and spawn's resource tracker)
        targets = {"ranks": ranks, "launcher": [proc.pid], "every process": job}[delivery]
        for pid in targets:
            os.kill(pid, signal.SIGTERM if delivery == "launcher" else signal.SIGUSR1)
        start = time.time()
        out, _ = proc.communicate(timeout=60)
        while any(alive(p) for p in job) and time.time() - start < 30:
            time.sleep(0.2)
        assert not [p for p in job if alive(p)] and time.time() - start < 30, f"{delivery}: {out[-3000:]}"
        if stopped:
            assert f"resumed from {tmp_path}/checkpoint/step-{stopped} at step {stopped}" in out, out[-3000:]
        stopped = int(re.search(r"stopping at step (\d+) on signal", out).group(1))
        assert steps_saved(tmp_path)[-1] == stopped and 'train.py", line' not in out, out[-3000:]  # no traceback
        # No rank failed (torchrun lists failed ranks' exit codes) and none had to be killed by torchrun after
        # its 30 s grace period: each exited by itself. (torchrun, signalled itself, re-raises the signal.)
        assert "exitcode" not in out and "forcefully exiting" not in out, f"{delivery}: {out[-3000:]}"
        assert proc.returncode == 0 or delivery != "ranks", out[-3000:]
    run(tmp_path, *args)
    assert logged(tmp_path) == reference["fsdp"]


@pytest.mark.slow
def test_ctrl_c_with_loader_workers_ends_the_process(tmp_path):
    """Ctrl-C (a bug's traceback exits the same way) on `python train.py` with loader workers: its traceback,
    then the process and its workers are gone. Python's own exit waited forever for the workers, which ignore
    the SIGTERM it sends them (they must outlive a job-wide preemption signal until their rank has saved)."""
    cmd = [sys.executable, "train.py", *train_args(tmp_path, *SMALL, "--training.steps", 1000,
                                                   "--data.num_workers", 1)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(proc, tmp_path, 2)
    job = [proc.pid] + descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    start = time.time()
    while any(alive(p) for p in job) and time.time() - start < 10:  # workers see their rank gone
        time.sleep(0.2)
    assert proc.returncode == 1 and "KeyboardInterrupt" in out, out[-3000:]
    assert not [p for p in job if alive(p)], out[-3000:]


# --- torchtitan's layout (written here with stock DCP; tests/test_titan.py runs the real torchtitan) ---------

def titan_save(path, model, optimizer=None, scheduler=None, step=0, dtype=None, version="0.2.2"):
    """A checkpoint laid out as torchtitan lays it out: the model at the top level under its names; a full save
    adds its flattened optimizer state, the lr scheduler's and its own state (pickled plain values) and the data
    loader's; its last save is the model alone in export_dtype. 0.3.0 names q, k and v qkv_linear.w* and the
    output layer lm_head, and keeps one fused q/k/v moment a layer: rows by kv head, each group's query heads,
    then its key and its value head (its FusedQKVLinear; the real one: tests/test_titan.py)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    state = titan_names({k: v.to(dtype or v.dtype) for k, v in model.state_dict().items()}, version)
    if optimizer is not None:
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        opt = get_optimizer_state_dict(model, optimizer, options=flat)
        if version == "0.3.0":
            a = model.args
            hd, per = a.dim // a.n_heads, a.n_heads // a.n_kv_heads
            for i, kind in itertools.product(range(a.n_layers), ("exp_avg", "exp_avg_sq", "step")):
                q, k, v = (opt.pop(f"state.layers.{i}.attention.{p}.weight.{kind}") for p in ("wq", "wk", "wv"))
                if kind != "step":
                    q, k, v = (x.view(a.n_kv_heads, -1, hd, a.dim) for x in (q, k, v))
                    q = torch.cat([q.view(a.n_kv_heads, per, hd, a.dim), k, v], 1).reshape(-1, a.dim)
                opt[f"state.layers.{i}.attention.qkv_linear.wqkv.weight.{kind}"] = q
            opt = {k.replace("state.output.", "state.lm_head."): v for k, v in opt.items() if "param_groups" not in k}
        state["optimizer"] = opt
        state["lr_scheduler"] = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        state["train_state"] = {"step": step, "ntokens_seen": 4096 * step}
        state["dataloader"] = {"dp_rank_0": {"token_buffer": [1, 2]}, "world_size": 1}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("version", ["0.3.0", "0.2.2"])
def test_initial_load_takes_torchtitan_layout_and_continues_its_run(tmp_path, caplog, version):
    """initial_load_path on torchtitan's layout: model-only takes the weights bit for bit; a full save with
    initial_load_model_only = false also brings the AdamW moments, the step and the lr schedule's position."""
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    import train
    from pretrain.checkpoint import Checkpointer
    from pretrain.faults import CheckpointError
    from model import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, max_seq_len=32)
    cfg = train.Config()
    cfg.lr_scheduler.warmup_steps, cfg.training.steps = 10, 20

    def trainer(seed):
        torch.manual_seed(seed)
        model = Transformer(args)
        model.init_weights()
        return (model, *train.build_optimizer(model, cfg, torch.device("cpu")))

    theirs, their_opt, their_sched = trainer(0)
    for _ in range(3):  # three AdamW steps: moments and step counts to carry over
        their_opt.zero_grad()
        theirs(torch.randint(0, 384, (2, 16))).logsumexp(-1).mean().backward()
        their_opt.step()
        their_sched.step()
    titan_save(tmp_path / "full", theirs, their_opt, their_sched, step=3, version=version)
    titan_save(tmp_path / "export", theirs, dtype=torch.bfloat16, version=version)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def load(path, model_only):
            ours, opt, sched = trainer(1)
            ckpt_cfg = dataclasses.replace(cfg.checkpoint, initial_load_path=str(path),
                                           initial_load_model_only=model_only)
            ckpt = Checkpointer(ckpt_cfg, str(tmp_path), run_keys={}, steps=20, model=ours, optimizer=opt,
                                scheduler=sched, loader=None, notes={}, guard=None)
            return ckpt.resume(), ours, opt, sched

        (step, tokens), ours, opt, sched = load(tmp_path / "full", model_only=True)
        assert (step, tokens) == (0, 0) and sched.last_epoch == 0 and not opt.state
        for k, w in theirs.state_dict().items():
            assert torch.equal(ours.state_dict()[k], w), k
        (step, tokens), ours, _, _ = load(tmp_path / "export", model_only=True)  # bf16: rounded, as saved
        assert all(torch.equal(w, theirs.state_dict()[k].bfloat16().float()) for k, w in ours.state_dict().items())

        with caplog.at_level("INFO", logger="checkpoint"):
            (step, tokens), ours, opt, sched = load(tmp_path / "full", model_only=False)
        assert (step, tokens) == (3, 0) and sched.last_epoch == 3
        assert opt.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr * train.lr_factor(3, cfg), rel=1e-12)
        assert "not its data position" in caplog.text and "step 3" in caplog.text
        names = dict(theirs.named_parameters())
        their_state = {n: their_opt.state[p] for n, p in names.items()}
        for n, p in ours.named_parameters():
            assert torch.equal(p, names[n])
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][key], their_state[n][key]), (n, key)

        with pytest.raises(CheckpointError, match="model-only torchtitan save.*initial_load_model_only = true"):
            load(tmp_path / "export", model_only=False)
    finally:
        dist.destroy_process_group()


class NoData:
    """A loader without streams: the data's part of a checkpoint, empty."""
    stream_ids = []

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_resume_trains_at_the_new_peak_lr_and_schedule(tmp_path):
    """optimizer.lr, the [lr_scheduler] keys and training.steps may change on a resume (checkpoint.RESUME_MAY_CHANGE):
    the lr in force after it is the new config's at the checkpoint's step, not the one the checkpoint last set
    (LambdaLR's own load brings back its base_lrs). Without a change, the saved lr to the bit."""
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    import train
    from model import ModelArgs, Transformer
    from pretrain.checkpoint import Checkpointer
    from pretrain.spikes import SpikeGuard

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=384, max_seq_len=32)

    def checkpointer(cfg):
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        optimizer, scheduler = train.build_optimizer(model, cfg, torch.device("cpu"))
        ckpt_cfg = dataclasses.replace(cfg.checkpoint, enable=True)
        return Checkpointer(ckpt_cfg, str(tmp_path), run_keys={}, steps=cfg.training.steps, model=model,
                            optimizer=optimizer, scheduler=scheduler, loader=NoData(), notes={},
                            guard=SpikeGuard(cfg.spikes, "cpu"))

    old = train.Config()
    old.optimizer.lr, old.lr_scheduler.warmup_steps, old.training.steps = 1e-3, 2, 10
    new = train.Config()
    new.optimizer.lr, new.lr_scheduler.warmup_steps, new.training.steps = 5e-4, 1, 12
    new.lr_scheduler.decay_ratio, new.lr_scheduler.decay_type, new.lr_scheduler.min_lr_factor = 0.5, "cosine", 0.1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saving = checkpointer(old)
        for _ in range(3):
            saving.optimizer.zero_grad()
            saving.model(torch.randint(0, 384, (2, 16))).logsumexp(-1).mean().backward()
            saving.optimizer.step()
            saving.scheduler.step()
        saving.save(3, 0, final=True)
        saved_lr = saving.optimizer.param_groups[0]["lr"]

        same = checkpointer(old)
        assert same.resume() == (3, 0) and same.optimizer.param_groups[0]["lr"] == saved_lr
        ours = checkpointer(new)
        assert ours.resume() == (3, 0)
        for step in (3, 4, 5):  # the lr of steps 4, 5 and 6 (0-based factors)
            assert ours.optimizer.param_groups[0]["lr"] == new.optimizer.lr * train.lr_factor(step, new), step
            assert ours.scheduler.get_last_lr() == [ours.optimizer.param_groups[0]["lr"]]
            ours.scheduler.step()
    finally:
        dist.destroy_process_group()


BEFORE_ISSUE_61 = "ba62262"  # the last commit before train.py's loop and its machinery were reshaped


@pytest.mark.slow
def test_a_checkpoint_written_before_the_loop_was_reshaped_resumes_exactly(tmp_path):
    """Issue 61 moved the loop's machinery out of train.py (the step's agreement, the log's sums, the config's rules,
    the resume policy) as a refactor, bit for bit: a step-2 that the code before wrote resumes here to the same
    losses, to the last bit, as that code trains on from it."""
    git = ["git", "-C", ROOT]
    if subprocess.run([*git, "cat-file", "-e", f"{BEFORE_ISSUE_61}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"commit {BEFORE_ISSUE_61} is not in this clone's history")
    before = tmp_path / "before"
    subprocess.run([*git, "worktree", "add", "--detach", str(before), BEFORE_ISSUE_61], check=True,
                   capture_output=True)
    try:
        argv = [sys.executable, "train.py", *train_args(tmp_path / "old", *SMALL, "--training.steps", 4,
                                                        "--checkpoint.interval", 2)]
        proc = subprocess.run(argv, cwd=before, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(before)], capture_output=True)
    old = logged(tmp_path / "old")
    shutil.copytree(tmp_path / "old", tmp_path / "new", ignore=shutil.ignore_patterns("step-4", "metrics.jsonl"))
    out = run(tmp_path / "new", *SMALL, "--training.steps", 4, "--checkpoint.interval", 2, nproc=1)
    assert f"resumed from {tmp_path / 'new'}/checkpoint/step-2 at step 2" in out
    assert logged(tmp_path / "new") == {3: old[3], 4: old[4]}
