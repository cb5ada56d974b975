"""The trainer's GPU paths, one test body per device: here on the CPU (fast twins), and unchanged on a GPU under

    python -m pytest -m gpu            # on a node with CUDA: a few minutes on one GPU, 2 processes when there are 2

bf16 mixed precision, per-block compile, selective and full activation checkpointing, async checkpoints and a
bitwise-exact resume, fused AdamW, Muon with phases (a new batch and sequence length under compile, then an anneal),
and checkpoint_convert.py dcp2hf logits against transformers on the device. The cuda cases are marked `gpu` and
skip without CUDA (conftest.DEVICES). The runs are tiny (the SMALL shape: 2 of the debug model's blocks, sequences
of 64 tokens; 4-6 steps) and shared between tests: five train.py runs per device.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import DEVICES, ROOT, SMALL
from test_convert import convert, read_dcp_model
from test_phases import config as phased_config

BASE = ["--config", "configs/debug_model.toml", *SMALL, "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--validation.enable", "false", "--training.deterministic"]
# The run under test: bf16, compile, selective AC, async checkpoints at steps 2 and 4. Deterministic algorithms
# (and cuBLAS's fixed workspace, below) so that a resume can be compared bit for bit on a GPU too.
MAIN = [*BASE, "--training.steps", "4", "--training.mixed_precision_param", "bfloat16", "--compile.enable",
        "--activation_checkpoint.mode", "selective", "--checkpoint.enable", "--checkpoint.async_mode", "async",
        "--checkpoint.interval", "2"]
# The same run with Muon and two phases: from step 3 a batch of 4 (grad accumulation 2 on one device) of 128 tokens,
# which compile meets as a new shape, and from step 5 an anneal that upsamples FineMath. Saves at 2, 4 and 6.
PHASES = """
[[phases]]
start_step = 3
global_batch_size = 4
seq_len = 128

[[phases]]
start_step = 5
weights = { finemath = 0.7 }
anneal = true
"""
MUON = [*MAIN[2:], "--training.steps", "6", "--optimizer.name", "Muon"]  # MAIN without its --config


def nproc(device: str) -> int:
    return min(2, torch.cuda.device_count()) if device == "cuda" else 1


def train(device: str, dump, *args) -> subprocess.Popen:
    """Start train.py (under torchrun with 2 GPUs) on `device`: it takes the GPU itself when it sees one."""
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    n = nproc(device)
    launch = [] if n == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    return subprocess.Popen([sys.executable, *launch, "train.py", "--job.dump_folder", str(dump), *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def output(proc: subprocess.Popen) -> str:
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-4000:]
    return out


def records(dump) -> list:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(device) -> {name: (dump, output)}, each run once per device: `main` (MAIN), `resume` (a copy of
    main's folder resumed from its step-2), `fp32_full_ac` (float32, full AC, eager, 2 steps), `muon` (MUON with
    PHASES) and `muon_resume` (a copy of it resumed from its step-2, before both boundaries)."""
    done = {}

    def get(device):
        if device not in done:
            tmp = tmp_path_factory.mktemp(device)
            muon_args = ["--config", phased_config(tmp, PHASES), *MUON]
            main, full = train(device, tmp / "main", *MAIN), train(device, tmp / "full", *BASE, "--training.steps", "2",
                                                                    "--training.mixed_precision_param", "float32",
                                                                    "--activation_checkpoint.mode", "full")
            main, full = output(main), output(full)  # side by side: on 2 CPU cores, 10-15 s less
            muon = train(device, tmp / "muon", *muon_args)
            shutil.copytree(tmp / "main", tmp / "resume")
            resume = output(train(device, tmp / "resume", *MAIN, "--checkpoint.load_step", "2"))
            muon = output(muon)
            shutil.copytree(tmp / "muon", tmp / "muon_resume")
            muon_resume = output(train(device, tmp / "muon_resume", *muon_args, "--checkpoint.load_step", "2"))
            done[device] = {"main": (tmp / "main", main), "resume": (tmp / "resume", resume),
                            "fp32_full_ac": (tmp / "full", full), "muon": (tmp / "muon", muon),
                            "muon_resume": (tmp / "muon_resume", muon_resume)}
        return done[device]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compile_selective_ac_trains_on_the_device(device, runs):
    dump, out = runs(device)["main"]
    rec = records(dump)
    assert [r["step"] for r in rec] == [1, 2, 3, 4]
    assert all(0 < r["loss"] < 10 for r in rec) and rec[-1]["loss"] < rec[0]["loss"], rec
    # The device the run used: the GPU's caching allocator reports allocated memory, the CPU does not.
    assert all((r["memory_allocated_gib"] is not None) == (device == "cuda") for r in rec), rec
    assert "(async)" in out


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_full_ac_stay_close_to_fp32(device, runs):
    bf16 = [r["loss"] for r in records(runs(device)["main"][0])][:2]
    fp32 = [r["loss"] for r in records(runs(device)["fp32_full_ac"][0])]
    assert len(fp32) == 2 and fp32 != bf16  # another dtype: not bitwise the same
    assert bf16 == pytest.approx(fp32, rel=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_async_checkpoint_resume_is_bitwise_exact(device, runs):
    main_dump, _ = runs(device)["main"]
    dump, out = runs(device)["resume"]
    assert f"resumed from {dump}/checkpoint/step-2 at step 2" in out, out[-3000:]
    rec, want = records(dump), records(main_dump)
    assert [r["step"] for r in rec] == [1, 2, 3, 4, 3, 4]  # the copy's four, then steps 3-4 again
    assert [r["loss"] for r in rec[4:]] == [r["loss"] for r in want[2:]]
    assert [r["grad_norm"] for r in rec[4:]] == [r["grad_norm"] for r in want[2:]]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_muon_with_phases_trains_compiled_and_resumes_bitwise_across_the_boundaries(device, runs):
    (dump, out), (again, resumed) = runs(device)["muon"], runs(device)["muon_resume"]
    rec = records(dump)
    assert [r["phase"] for r in rec] == [0, 0, 1, 1, 2, 2]
    n = 2 * nproc(device)  # phase 0's global batch: local 2 on each rank
    assert [r["tokens_seen"] for r in rec] == [64 * n, 128 * n, *(128 * n + 512 * k for k in (1, 2, 3, 4))]
    assert "phase 1 from step 3: global batch 4 x seq_len 128" in out and "the lr anneals linearly to 0" in out
    assert all(0 < r["loss"] < 10 for r in rec) and rec[-1]["lr"] == 0.0
    assert f"resumed from {again}/checkpoint/step-2 at step 2" in resumed, resumed[-3000:]
    got = records(again)[6:]  # after the copy's six: steps 3-6 again, through both boundaries
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [(r["step"], r["loss"], r["grad_norm"])
                                                                    for r in rec[2:]]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_matches_the_reference_update(device):
    """train.build_optimizer takes the fused AdamW kernel on every device; its steps match the plain for-loop AdamW."""
    import train
    cfg = train.Config()
    torch.manual_seed(0)
    w0, grads = torch.randn(64, 32), [torch.randn(64, 32) for _ in range(3)]
    w, ref = torch.nn.Parameter(w0.clone().to(device)), torch.nn.Parameter(w0.clone())
    opt, _ = train.build_optimizer(torch.nn.ParameterList([w]), cfg, torch.device(device))
    assert opt.defaults["fused"] is True
    o = cfg.optimizer  # the lr as the schedule set it for step 0 (warmup)
    ref_opt = torch.optim.AdamW([ref], lr=opt.param_groups[0]["lr"], betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                foreach=False)
    for g in grads:
        w.grad, ref.grad = g.to(device), g.clone()
        opt.step(), ref_opt.step()
    assert not torch.equal(w.detach().cpu(), w0)
    torch.testing.assert_close(w.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_dcp2hf_logits_match_transformers_on_the_device(device, runs, tmp_path):
    from transformers import LlamaForCausalLM

    import model as M
    step = runs(device)["main"][0] / "checkpoint" / "step-4"
    convert("dcp2hf", step, tmp_path / "hf", "--tokenizer_path", os.path.join(ROOT, "assets/tokenizer/tokenizer.model"))
    with open(step / "params.json") as f:
        args = M.ModelArgs(**json.load(f))
    ours = M.Transformer(args)
    ours.load_state_dict(read_dcp_model(step))  # the trainer's fp32 weights
    ours = ours.to(device).eval()
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).to(device).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert got.device.type == device
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
