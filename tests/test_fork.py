"""Research edits: new parameters (QK-norm) train alike on 1 process, FSDP and TP with no trainer change; a
new objective replaces train.forward_backward; a new config field needs no doc comment and is a resume key."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import SMALL, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pretrain import resume_keys  # noqa: E402
from pretrain import config  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402


def step_losses(dump):
    return [r["loss"] for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r]


def qknorm_losses(dump, *args, nproc=1):
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", dump, "--training.steps", "3",
            "--metrics.log_freq", "1", "--validation.enable", "false", *SMALL, *args]
    proc = run_training(argv, nproc, program="tests/qknorm_train.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return step_losses(dump)


@pytest.mark.slow
def test_qk_norm_subclass_trains_alike_on_one_process_fsdp_and_tp(tmp_path):
    one = qknorm_losses(tmp_path / "one")
    fsdp = qknorm_losses(tmp_path / "fsdp", "--training.local_batch_size", "4", nproc=2)
    tp = qknorm_losses(tmp_path / "tp", "--parallelism.tensor_parallel_degree", "2", nproc=2)
    assert len(one) == 3 and one[2] < one[0]
    assert fsdp == pytest.approx(one, rel=1e-5) and tp == pytest.approx(one, rel=1e-5)


def test_init_weights_default_rules_for_new_parameters_of_any_shape():
    args = model.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
    m = model.Transformer(args)
    block = m.layers[0]  # what research edits add: a biased projection, a norm, a gate, experts, a scale
    block.proj = torch.nn.Linear(64, 64, bias=True)
    block.q_norm = model.RMSNorm(16, 1e-5)
    block.gate = torch.nn.Parameter(torch.empty(64))
    block.experts = torch.nn.Parameter(torch.empty(4, 64, 32))
    block.scale = torch.nn.Parameter(torch.empty(()))
    for init in (None, train.layout_independent_normal(seed=0)):  # torch's RNG, and train.py's keyed fill
        torch.manual_seed(0)
        m.init_weights(normal_=init)
        assert torch.equal(block.proj.bias, torch.zeros(64)) and torch.equal(block.q_norm.weight, torch.ones(16))
        for w in (block.proj.weight, block.gate, block.experts):
            assert 0.015 < w.std() < 0.025 and w.abs().max() <= 0.06, w.shape
        assert 0 < block.scale.abs() <= 0.06
    # FSDP2 shards along dim 0, so a scalar cannot be trained under it: one line at start-up, not fully_shard's
    # traceback from inside parallelize()
    with pytest.raises(config.ConfigError, match=r"^parameter layers.0.scale has shape \(\): .*give it shape \(1,\)$"):
        train.apply_fsdp(m, None, torch.float32, torch.float32)


# Three runs in one process (a process each would spend ~4.5 s more importing torch): plain, with the z_loss key,
# and with a forker's objective swapped in for train.forward_backward (main() looks the name up at each call).
THREE_RUNS = r"""
import sys
from functools import partial

import torch

sys.path.insert(0, ".")
import train  # noqa: E402
from pretrain.loss import chunked_loss, cross_entropy_and_z  # noqa: E402

plain_forward_backward = train.forward_backward


def forward_backward(model, inputs, labels, global_tokens, dp, tp, z_loss=0.0):
    # a forker's objective: the cross-entropy plus 1e-2 x the mean square of the final norm's output
    h = model(inputs, last_hidden=True)  # (bs, seqlen, dim), RMS-normalised: its mean square is ~1
    shares = chunked_loss(model.output, h, labels, partial(cross_entropy_and_z, z_loss=z_loss)) / global_tokens
    shares = shares + torch.stack([1e-2 * h.pow(2).mean(), torch.zeros(())])  # (2,): the logged loss, the z term
    (shares.sum() * dp).backward()
    return shares.detach()


dumps, args = sys.argv[1:4], sys.argv[4:]
for dump, extra, fb in ((dumps[0], [], plain_forward_backward), (dumps[1], ["--training.z_loss", "1e-2"],
                        plain_forward_backward), (dumps[2], [], forward_backward)):
    train.forward_backward = fb
    train.main(train.load_config([*args, *extra, "--job.dump_folder", dump]))
"""


@pytest.mark.slow
def test_z_loss_is_a_key_and_a_new_objective_replaces_forward_backward(tmp_path):
    args = ["--config", "configs/debug_model.toml", "--training.steps", "1", "--metrics.log_freq", "1",
            "--validation.enable", "false", *SMALL]
    dumps = [str(tmp_path / "plain"), str(tmp_path / "zloss"), str(tmp_path / "swapped")]
    proc = subprocess.run([sys.executable, "-c", THREE_RUNS, *dumps, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    plain, zloss, swapped = (json.loads(open(os.path.join(d, "metrics.jsonl")).readline()) for d in dumps)
    # Same weights and batch at step 1: the same cross-entropy; the z term is 1e-2 x E[logsumexp^2], with
    # logsumexp ~ log(2048 tokens) + ~0.5 at init
    assert zloss["loss"] == plain["loss"] and 0.4 < zloss["z_loss"] < 1.0, (plain, zloss)
    assert "z_loss" not in plain and f"  z_loss: {zloss['z_loss']:.4g}" in proc.stdout
    assert 0.0099 < swapped["loss"] - plain["loss"] < 0.0101, (plain, swapped)


def test_docs_come_from_comments_in_any_layout_and_a_field_may_have_none():
    @dataclasses.dataclass
    class Knobs:
        plain: int = 1
        # the comment line above
        above: int = 2
        multi: list = dataclasses.field(
            default_factory=list)  # on the default's last line
        tail: str = "x#y"  # after a '#' inside a string
    assert config._docs(Knobs) == {"plain": "", "above": "the comment line above", "multi": "on the default's last line",
                                  "tail": "after a '#' inside a string"}


@pytest.mark.slow
def test_a_new_field_needs_no_doc_and_is_a_resume_key(tmp_path):
    """Add `label_smoothing: float = 0.0` to [training] as a research edit would (no comment): --help and training work, and
    a resume with another value is refused naming it, with no edit to the resume keys."""
    fork = tmp_path / "fork"
    fork.mkdir()
    for name in os.listdir(ROOT):
        if name not in ("train.py", ".git", "outputs"):
            os.symlink(os.path.join(ROOT, name), fork / name)
    src = open(os.path.join(ROOT, "train.py")).read()
    anchor = "    steps: int = 10000"
    assert anchor in src
    (fork / "train.py").write_text(src.replace(anchor, "    label_smoothing: float = 0.0\n" + anchor))
    help_out = subprocess.run([sys.executable, "train.py", "--help"], cwd=fork, capture_output=True, text=True)
    assert help_out.returncode == 0 and "--training.label_smoothing FLOAT" in help_out.stdout and "(default: 0.0)" in help_out.stdout
    base = [sys.executable, "train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "run"),
            "--validation.enable", "false", "--checkpoint.enable", "--checkpoint.interval", "2", *SMALL]
    first = subprocess.run(base + ["--training.steps", "2"], cwd=fork, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    again = subprocess.run(base + ["--training.steps", "3", "--training.label_smoothing", "0.1"], cwd=fork,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "refusing to resume" in again.stderr and "training.label_smoothing: 0.0 -> 0.1" in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    # Keys on the documented list may change: the same resume with another peak lr goes on.
    again = subprocess.run(base + ["--training.steps", "3", "--optimizer.lr", "1e-3"], cwd=fork,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    shutil.rmtree(fork)


def test_resume_keys_are_every_checked_key_less_the_documented_list():
    cfg = train.load_config(["--config", "configs/debug_model.toml"])
    keys = train.resume_keys(cfg, train.flavor_args(cfg), train.validate(cfg, 1),
                             {"version": 1, "data": {}, "validation": {}})
    for sec in resume_keys.RESUME_CHECKED:
        for f in dataclasses.fields(getattr(cfg, sec)):
            assert (f"{sec}.{f.name}" in keys) != (f"{sec}.{f.name}" in resume_keys.RESUME_MAY_CHANGE), f"{sec}.{f.name}"
    assert keys["optimizer.weight_decay"] == 0.1 and "model.tokenizer_sha256" in keys
