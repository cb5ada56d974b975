"""Trainer features on one CPU process: accumulation, activation checkpointing, compile, metrics."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import SMALL, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ARGS = ("--config", "configs/debug_model.toml", "--metrics.log_freq", "1", "--validation.enable", "false",
        *SMALL)


def steps(dump):
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]  # training steps, not validation rounds


def train(dump, *args):
    proc = run_training([*ARGS, "--job.dump_folder", dump, *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, steps(dump)


def losses(records):
    return [r["loss"] for r in records]


# The eager runs the tests compare, each a name and its arguments. They share one process: main() closes
# its process group, loader and logs, and a process of its own would spend ~4.5 s a run importing torch.
RUNS = {
    "plain": ("--training.steps", "3"),  # local batch 8, no activation checkpointing, fp32: the baseline
    "accumulation": ("--training.steps", "3", "--training.local_batch_size", "4",
                     "--training.global_batch_size", "8"),
    **{f"{mode}-{option}": ("--training.steps", "3", "--activation_checkpoint.mode", mode,
                            "--activation_checkpoint.selective_ac_option", option)
       for mode, option in (("full", "op"), ("selective", "op"), ("selective", "2"))},
    "bf16": ("--training.steps", "3", "--training.mixed_precision_param", "bfloat16"),
    "peak": ("--training.steps", "2", "--metrics.peak_tflops", "0.5", "--metrics.enable_tensorboard",
             "--job.print_config"),
}
# Each run's stdout goes to stdout.txt in its dump folder.
IN_ONE_PROCESS = r"""
import contextlib
import json
import os
import re
import sys

import train

for dump, args in json.loads(sys.argv[1]):
    os.makedirs(dump)
    with open(os.path.join(dump, "stdout.txt"), "w") as out, contextlib.redirect_stdout(out):
        train.main(train.load_config([*args, "--job.dump_folder", dump]))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (dump folder, stdout, training steps) of each of RUNS."""
    pytest.importorskip("tensorboard")  # the peak run writes TensorBoard's events
    folder = tmp_path_factory.mktemp("runs")
    todo = [(str(folder / name), [*ARGS, *args]) for name, args in RUNS.items()]
    proc = subprocess.run([sys.executable, "-c", IN_ONE_PROCESS, json.dumps(todo)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    dumps = {name: folder / name for name in RUNS}
    return {name: (dump, (dump / "stdout.txt").read_text(), steps(dump)) for name, dump in dumps.items()}


@pytest.fixture(scope="module")
def baseline(runs):
    return runs["plain"][2]


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch(runs, baseline):
    records = runs["accumulation"][2]
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=1e-5)
    assert records[-1]["tokens_seen"] == baseline[-1]["tokens_seen"] == 3 * 8 * 64


@pytest.mark.slow
@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_does_not_change_the_math(runs, baseline, mode, option):
    records = runs[f"{mode}-{option}"][2]
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=1e-6)


# One forward + backward of the trainer's parallelized model per AC mode, counting the matmuls and attention
# calls that run (recomputation runs them again). A process of its own: it opens a 1-rank process group.
COUNT_OPS = r"""
import collections
import json
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
import train
from model import Transformer

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
result = {}
for mode in ("none", "selective", "full"):
    cfg = train.load_config(["--config", "configs/debug_model.toml", "--training.seq_len", "32",
                             "--training.local_batch_size", "2", "--activation_checkpoint.mode", mode])
    with torch.device("meta"):
        model = Transformer(train.flavor_args(cfg))
    train.parallelize(model, init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp")), cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    counts = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        model(torch.zeros(2, 32, dtype=torch.long)).sum().backward()
    result[mode] = {op: n for op, n in counts.items() if op == "mm" or "dot_product" in op}
print(json.dumps(result))
"""


@pytest.mark.slow
def test_selective_ac_recomputes_no_matmul_and_no_attention():
    """Selective AC (op) keeps every matmul's and attention's output, whichever SDPA kernel the device runs (the
    CPU's too): the same calls as without AC. Full AC runs each block's forward again."""
    proc = subprocess.run([sys.executable, "-c", COUNT_OPS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    attention = [op for op in counts["none"] if "dot_product" in op and "backward" not in op]
    assert attention and counts["none"][attention[0]] == 6  # one call per block
    assert counts["selective"] == counts["none"]
    assert counts["full"][attention[0]] == 12 and counts["full"]["mm"] > counts["none"]["mm"]


@pytest.mark.slow
def test_compile_per_block(baseline, tmp_path):
    _, records = train(tmp_path, "--training.steps", 3, "--compile.enable")
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=1e-4)  # fused kernels round differently, not much


@pytest.mark.slow
def test_each_shape_compiles_a_static_graph_of_its_own_and_a_run_has_room_for_all(monkeypatch):
    """A phase's new sequence length gets a static graph, as a resume past the boundary would compile it (by default
    the second length would make the sequence dimension dynamic, and the third would reuse that graph). A run with
    four phases, held-out windows and three eval tasks feeds the blocks 9 shapes, one past dynamo's default limit of
    8, where a fullgraph compile raised FailOnRecompileLimitHit mid-run; parallelize makes room for them. (Dynamo's
    graphs are counted by an eager backend in inductor's place: apply_compile's settings are kept.)"""
    import dataclasses
    import types
    import torch
    from torch._dynamo.testing import CompileCounter

    import train
    from model import Transformer
    from pretrain.evals import EvalTask
    counter, compile_ = CompileCounter(), torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, **kw, backend=counter))
    limit = torch._dynamo.config.recompile_limit
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", limit)  # put back after the test
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--model.n_layers", "1",
                             "--compile.enable", "--activation_checkpoint.mode", "none"])
    lengths = (16, 32, 24, 40, 48)  # [training] seq_len, then each phase's
    cfg.phases = [dataclasses.replace(cfg.phases[0], start_step=10 * i, seq_len=n) for i, n in enumerate(lengths) if i]
    cfg.eval.tasks = [EvalTask(name) for name in ("hellaswag", "arc_easy", "piqa")]
    model = Transformer(train.flavor_args(cfg))
    one_rank = types.SimpleNamespace(size=lambda: 1)
    mesh = type("Mesh", (), {"device_type": "cpu", "__getitem__": lambda self, key: one_rank})()
    train.parallelize(model, mesh, cfg)
    torch._dynamo.reset()
    for seq_len in (*lengths, 32):  # training: a graph per phase's length, the one seen before reused
        model(torch.zeros(1, seq_len, dtype=torch.long))
    assert counter.frame_count == 5
    model.eval()
    with torch.no_grad():
        for width in (16, 64, 128, 192):  # the held-out windows, then each task's row width
            model(torch.zeros(2, width, dtype=torch.long))
    assert counter.frame_count == 9


@pytest.mark.slow
def test_bf16_mixed_precision_stays_close_to_fp32(runs, baseline):
    records = runs["bf16"][2]
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=2e-2)
    assert "x tp 1, no FSDP (one dp rank), bfloat16 autocast, grad accumulation 1;" in runs["bf16"][1]


def test_the_start_up_line_names_autocast_only_where_it_is_applied():
    import torch

    import train
    from model import Transformer
    lines = {}
    for precision in ("float32", "bfloat16"):
        cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"),
                                 "--training.mixed_precision_param", precision])
        with torch.device("meta"):
            model = Transformer(train.flavor_args(cfg, vocab_size=64))
        lines[precision] = train.run_summary(cfg, model, 1, train.validate(cfg, 1))
    assert "x tp 1, no FSDP (one dp rank), float32, grad accumulation 1;" in lines["float32"]
    assert "x tp 1, no FSDP (one dp rank), bfloat16 autocast, grad accumulation 1;" in lines["bfloat16"]


def test_one_data_parallel_rank_trains_unsharded_fp32_weights_under_autocast():
    """One process (or TP alone): no fully_shard, so no bf16 copy of each weight twice a step; the forward and the
    output layer the loss calls run in bf16 under autocast, over fp32 weights and gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import train
    from model import Transformer
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--model.n_layers", "1",
                             "--training.mixed_precision_param", "bfloat16"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = Transformer(train.flavor_args(cfg, vocab_size=64))
        model.init_weights()
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        train.parallelize(model, mesh, cfg)
        h = model(torch.zeros(2, 16, dtype=torch.long), last_hidden=True)
        logits = model.output(h)
        logits.float().sum().backward()
    finally:
        dist.destroy_process_group()
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert logits.dtype == torch.bfloat16  # the matmul ran in bf16


@pytest.mark.slow
def test_mfu_with_configured_peak_and_tensorboard(runs):
    dump, out, records = runs["peak"]
    assert all(r["mfu"] == pytest.approx(100 * r["tflops"] / 0.5) for r in records)
    assert "mfu: n/a" not in out and "mfu: " in out
    tb = os.path.join(dump, "tb")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))


@pytest.mark.slow
def test_mfu_is_na_on_cpu_without_a_peak(baseline):
    assert all(r["mfu"] is None for r in baseline)
    # FLOPs per token: 6 x non-embedding params + 12 x layers x heads x head_dim x seq_len
    flops_per_token = 6 * (2_622_720 - 2048 * 256) + 12 * 2 * 16 * 16 * 64
    assert baseline[-1]["tflops"] == pytest.approx(flops_per_token * baseline[-1]["tps"] / 1e12)


@pytest.mark.slow
def test_the_config_goes_to_config_toml_and_one_summary_line(runs):
    dump, out, _ = runs["plain"]
    assert "[training]" not in out and (dump / "config.toml").read_text().count("[training]") == 1
    summary = [ln for ln in out.splitlines() if "2,622,720 parameters" in ln]
    assert len(summary) == 1 and f"config in {dump}/config.toml" in summary[0]
    out = runs["peak"][1]  # --job.print_config
    assert "[training]" in out and "local_batch_size = 8" in out


def test_the_eta_counts_the_steps_left_and_the_rounds_still_due():
    """A run of 100 steps, validation every 20, evals every 25, a save every 30 (and each at the last step),
    on a fake clock: steps take 2 s after a first one of 30 s (compile), validation 5 s, an eval 7 s, a save
    3 s, and a log line every 10 steps comes before its step's rounds. At step 40's line the ETA is 60 steps
    x 2 s plus the rounds at steps 40-100 at their measured cost: validation at 40, 60, 80, 100 (4 x 5 s),
    evals at 50, 75, 100 (3 x 7 s), saves at 60, 90, 100 (3 x 3 s)."""
    from pretrain.progress import RunClock, duration
    t = [0.0]
    clock = RunClock(100, {"validation": 20, "eval": 25, "checkpoint": 30}, now=lambda: t[0])
    t[0] = 10.0  # start-up
    clock.lap(0)
    logged = 0
    for step in range(1, 41):
        t[0] += 30.0 if step == 1 else 2.0
        if step in (1, 10, 20, 30, 40):
            lap = clock.lap(step - logged)
            logged = step
            if step == 40:
                break
        for kind, every, seconds in (("validation", 20, 5.0), ("eval", 25, 7.0), ("checkpoint", 30, 3.0)):
            if step % every == 0:
                with clock.timed(kind):
                    t[0] += seconds
    assert lap == 20.0  # steps 31-40, the save at 30 left out
    times = clock.times(40)
    assert times["eta_seconds"] == 60 * 2.0 + 4 * 5.0 + 3 * 7.0 + 3 * 3.0  # the 30 s step left out
    assert times["elapsed_seconds"] == 10.0 + 30.0 + 39 * 2.0 + 5.0 + 7.0 + 3.0
    assert clock.spent == {"validation": 5.0, "eval": 7.0, "checkpoint": 3.0, "rewind": 0.0}
    assert clock.times(100)["eta_seconds"] == 5.0 + 7.0 + 3.0  # the last step's rounds, after its line
    assert [duration(s) for s in (59.6, 3725, 52260, 183600)] == ["1m00s", "1h02m", "14h31m", "2d03h"]


@pytest.mark.slow
def test_each_log_line_ends_with_elapsed_and_eta_and_the_run_with_a_summary(runs):
    dump, out, records = runs["plain"]
    lines = [ln for ln in out.splitlines() if ln.startswith("step: ")]
    assert len(lines) == 3 and all(re.search(r"  elapsed \d+m\d\ds  eta \d+m\d\ds$", ln) for ln in lines), lines
    assert records[-1]["eta_seconds"] == 0 and records[0]["eta_seconds"] > 0
    assert all(a["elapsed_seconds"] < b["elapsed_seconds"] for a, b in zip(records, records[1:]))
    done = [ln for ln in out.splitlines() if ln.startswith("done: ")]
    wall = re.search(r"tokens, (\d+m\d\ds) wall", done[0])[1]
    assert done == [f"done: step 3, {records[-1]['tokens_seen']:,} tokens, {wall} wall; loss "
                    f"{records[-1]['loss']:.4f}; validation 0.0s, evals 0.0s, saves 0.0s"], done


def test_bf16_optimizer_states_take_adamws_step_with_half_the_bytes():
    """[optimizer] state_dtype = "bfloat16": AdamW's update (fp32 math) with the moments rounded to bf16 between
    steps: after 5 steps the weights are AdamW's within that rounding, and the moments take 2 bytes each."""
    import torch

    from pretrain import optimizers
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(32)]
    ours = [w.clone().requires_grad_() for w in weights]
    theirs = [w.clone().requires_grad_() for w in weights]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    pair = [optimizers.AdamWBF16State(ours, **kwargs), torch.optim.AdamW(theirs, **kwargs)]
    for _ in range(5):
        grads = [torch.randn_like(w) for w in weights]
        for params, opt in zip((ours, theirs), pair):
            for q, g in zip(params, grads):
                q.grad = g.clone()
            opt.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)  # 5 steps of 1e-2 at most, moments within 0.4%
    state = pair[0].state[ours[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and state["step"] == 5


def test_bf16_moments_decay_as_fp32_ones_up_to_the_beta2_validate_allows():
    """With no more gradient, exp_avg_sq falls by beta2 a step. Rounded to bf16 each step, it follows fp32's at the
    beta2 optimizers.check allows (0.99: within 2x after 500 steps, fp32 6.6e-5), and stays put at 0.999, which it
    refuses: the effective lr would fall silently."""
    import torch

    import train
    from pretrain import optimizers

    def exp_avg_sq_after(beta2, steps):
        w = torch.zeros(4, requires_grad=True)
        opt = optimizers.AdamWBF16State([w], lr=1e-3, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0)
        w.grad = torch.ones(4)
        opt.step()  # exp_avg_sq = 1 - beta2
        w.grad = torch.zeros(4)
        for _ in range(steps):
            opt.step()
        return opt.state[w]["exp_avg_sq"].float()[0].item()

    assert optimizers.AdamWBF16State.MAX_BETA2 == 0.99
    fp32 = 0.01 * 0.99**500
    assert fp32 / 2 < exp_avg_sq_after(0.99, 500) < fp32 * 2
    start = exp_avg_sq_after(0.999, 0)
    assert exp_avg_sq_after(0.999, 1000) == start  # fp32: 0.37 x start
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"),
                             "--optimizer.state_dtype", "bfloat16", "--optimizer.beta2", "0.99"])
    train.validate(cfg, 1)


BF16_STATES = r"""
import json
import shutil
import sys

import train

dump, args = sys.argv[1], json.loads(sys.argv[2])
for name, extra in (("fp32", []), ("bf16", ["--optimizer.state_dtype", "bfloat16"])):
    train.main(train.load_config([*args, *extra, "--job.dump_folder", f"{dump}/{name}"]))
shutil.copytree(f"{dump}/bf16/checkpoint/step-25", f"{dump}/resumed/checkpoint/step-25")
shutil.copy(f"{dump}/bf16/data_manifest.json", f"{dump}/resumed/")
train.main(train.load_config([*args, "--optimizer.state_dtype", "bfloat16", "--job.dump_folder", f"{dump}/resumed"]))
"""


@pytest.mark.slow
def test_bf16_optimizer_states_train_within_0_02_of_fp32_and_resume_exactly(tmp_path):
    # the optimizer's state alone: the plain schedule (the config's [[phases]] anneal at the end, which this bound
    # was not measured with)
    args = [*ARGS, "--training.steps", "50", "--checkpoint.enable", "--checkpoint.interval", "25", "--phases", "none"]
    proc = subprocess.run([sys.executable, "-c", BF16_STATES, str(tmp_path), json.dumps(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    fp32, bf16, resumed = (losses(steps(tmp_path / name)) for name in ("fp32", "bf16", "resumed"))
    print(f"step 50: fp32 states {fp32[-1]:.4f}, bf16 states {bf16[-1]:.4f}")
    assert len(fp32) == len(bf16) == 50 and all(abs(a - b) < 0.02 for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert resumed == bf16[25:]  # bit for bit: the bf16 moments are in the checkpoint as they were
