"""Trainer features on one CPU process: accumulation, activation checkpointing, compile, metrics."""

import json
import os
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
def test_bf16_mixed_precision_stays_close_to_fp32(runs, baseline):
    records = runs["bf16"][2]
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=2e-2)


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
