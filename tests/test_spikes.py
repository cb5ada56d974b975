"""Loss spikes (pretrain/spikes.py): the guard's statistics; a planted spike or NaN skipped with the weights and
AdamW's state untouched; a resume across it; a rewind past the data of repeated spikes; the same decision on 2
FSDP ranks. Runs train conftest.SMALL with a window of 4 steps (spikes are looked for from step 3 on) and sigma 100:
a 4-step window of the first steps has a tiny spread (the grad norm's 0.02), which the next steps leave by 30 sigma,
and the planted spike by thousands.

The plant (planted_train, below, run as a training program): the model's output layer multiplies its logits
by 50 (a spike) or by NaN at the steps of $PLANT, e.g. "6:spike,7:nan", each once, on rank $PLANT_RANK (every
rank if unset); "stop" sends the process SIGTERM, and "6@2:..." plants at the second time step 6 is trained
(after a rewind), "9:spike+stop" both. It writes DUMP/steps.rank{R}.jsonl: at the start of each step, sha256
of the weights, of AdamW's state and of the step's first batch."""

import collections
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conftest import SMALL, run_training  # noqa: E402
from pretrain import spikes  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402

WINDOW = ("--spikes.window", "4", "--spikes.sigma", "100")


def sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def planted_train(argv):
    import train
    plant = dict(item.split(":") for item in os.environ.get("PLANT", "").split(",") if item)
    trained = collections.Counter()  # step -> the times this launch has trained it
    rank = int(os.environ.get("RANK", 0))
    planted_here = os.environ.get("PLANT_RANK", str(rank)) == str(rank)
    held = {}
    build = train.build_optimizer
    fb = train.forward_backward

    def build_optimizer(model, cfg, device, plan=None):
        held["model"] = model
        held["optimizer"], held["scheduler"] = build(model, cfg, device, plan)
        held["log"] = open(os.path.join(cfg.job.dump_folder, f"steps.rank{rank}.jsonl"), "a")
        return held["optimizer"], held["scheduler"]

    def forward_backward(model, inputs, labels, global_tokens, dp, tp, z_loss=0.0):
        step = held["scheduler"].last_epoch + 1
        kinds = []
        if held.get("step") != step:  # the step's first micro-batch
            held["step"] = step
            trained[step] += 1
            kinds = plant.pop(f"{step}@{trained[step]}", "")
            if trained[step] == 1:
                kinds = kinds or plant.pop(str(step), "")
            kinds = kinds.split("+")
            opt = held["optimizer"]
            adam = [v for s in opt.state.values() for v in s.values()]
            held["log"].write(json.dumps({"step": step, "weights": sha(model.parameters()), "adam": sha(adam),
                                          "batch": sha([inputs]), "lr": opt.param_groups[0]["lr"]}) + "\n")
            held["log"].flush()
        kinds = kinds if planted_here else []
        if "stop" in kinds:  # a preemption's signal, taken at the step's agreement
            os.kill(os.getpid(), signal.SIGTERM)
        kind = next((k for k in kinds if k in ("spike", "nan")), None)
        hook = None
        if kind:
            factor = 50.0 if kind == "spike" else math.nan
            hook = model.output.register_forward_hook(lambda m, i, out: out * factor)
        try:
            return fb(model, inputs, labels, global_tokens, dp, tp, z_loss)
        finally:
            if hook:
                hook.remove()

    train.build_optimizer = build_optimizer
    train.forward_backward = forward_backward
    train.main(train.load_config(argv))


def run(dump, *args, plant="", nproc=1, plant_rank=None, env=None):
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
            "--validation.enable", "false", "--training.steps", "12", *SMALL, *WINDOW, *map(str, args)]
    env = {"CHECK": "planted_train", "PLANT": plant, "PLANT_RANK": plant_rank and str(plant_rank), **(env or {})}
    proc = run_training(argv, nproc, program=__file__, env={k: v for k, v in env.items() if v is not None})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def records(dump) -> list:
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


def losses(dump) -> dict:
    return {r["step"]: r["loss"] for r in records(dump) if "loss" in r}


def steps(dump, rank=0) -> list:
    return [json.loads(line) for line in open(os.path.join(dump, f"steps.rank{rank}.jsonl"))]


def at(dump, step, rank=0) -> dict:
    return next(s for s in steps(dump, rank) if s["step"] == step)


def copy_until(src, dst, step):
    """A dump folder as it was when step-`step` was the newest checkpoint: the run's files, no later step-N."""
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step-") and
                                                       int(n[5:]) > step or n in ("metrics.jsonl", ".lock")
                                                       or n.startswith("steps.rank")])


# --- the guard alone ----------------------------------------------------------------------------

def guard_after(values, **cfg):
    g = spikes.SpikeGuard(spikes.Spikes(**{"window": 8, **cfg}), "cpu")
    for v in values:  # kept, whatever the check says
        g.check([torch.tensor(v)], torch.tensor(1.0), None)
        g.keep()
    return g


def test_a_step_far_above_the_window_is_a_spike_once_half_the_window_is_in():
    g = guard_after([2.0, 2.1])  # 2 of 8 kept: not yet looked at
    assert g.check([torch.tensor(50.0)], torch.tensor(1.0), None).tolist() == [0, 0]
    g = guard_after([2.0, 2.1, 1.9, 2.0])  # half of the window: mean 2.0, std 0.08
    assert g.check([torch.tensor(2.4)], torch.tensor(1.0), None).tolist() == [0, 0]  # under 2.0 + 6 x 0.08
    assert g.check([torch.tensor(2.6)], torch.tensor(1.0), None).tolist() == [0, 1]
    assert g.check([torch.tensor(2.0)], torch.tensor(math.inf), None).tolist() == [1, 0]  # the grad norm too
    assert g.check([torch.tensor(math.nan)], torch.tensor(1.0), None).tolist() == [1, 0]
    assert guard_after([2.0] * 4, sigma=0).check([torch.tensor(1e9)], torch.tensor(1.0), None).tolist() == [0, 0]


def test_the_window_keeps_the_last_kept_steps_and_its_state_round_trips():
    g = guard_after([1.0] * 8 + [3.0] * 8)  # a full window, written around once: only the 3.0s remain
    assert g.check([torch.tensor(3.0)], torch.tensor(1.0), None).tolist() == [0, 0]
    assert g.check([torch.tensor(3.0001)], torch.tensor(1.0), None).tolist() == [0, 1]  # std 0: any rise
    g.skip(17, not_finite=False)
    h = spikes.SpikeGuard(spikes.Spikes(window=8), "cpu")
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))  # as checkpoints hold it
    assert torch.equal(h.values, g.values) and h.state_dict() == g.state_dict() and h.skipped == 1
    small = spikes.SpikeGuard(spikes.Spikes(window=4), "cpu")  # another window on resume: it fills afresh
    small.load_state_dict(g.state_dict())
    assert small.kept == 0 and small.skipped == 1


def test_the_window_holds_the_steps_loss_whatever_sigma(monkeypatch):
    """sigma 0 looks for no spike, but its window and a skip's record still hold the step's loss (the shares
    summed over the dp ranks), not one rank's share: a resume with sigma > 0 then compares like with like."""
    def two_ranks(tensor, group=None):  # an all-reduce over 2 dp ranks whose shares are this rank's
        tensor.mul_(2)

    monkeypatch.setattr(spikes.dist, "all_reduce", two_ranks)
    dp_group = object()
    off = spikes.SpikeGuard(spikes.Spikes(window=4, sigma=0), "cpu")
    on = spikes.SpikeGuard(spikes.Spikes(window=4, sigma=6), "cpu")
    for guard in (off, on):
        for share in (1.0, 1.1, 0.9, 1.0):  # a loss of about 2.0 over both ranks
            guard.check([torch.tensor(share)], torch.tensor(1.0), dp_group)
            guard.keep()
    assert torch.equal(off.values, on.values) and off.values[0].tolist() == pytest.approx([2.0, 2.2, 1.8, 2.0])
    resumed = spikes.SpikeGuard(spikes.Spikes(window=4, sigma=6), "cpu")
    resumed.load_state_dict(off.state_dict())
    assert resumed.check([torch.tensor(1.1)], torch.tensor(1.0), dp_group).tolist() == [0, 0]  # 2.2: no spike
    off.check([torch.tensor(math.nan)], torch.tensor(1.0), dp_group)
    off.check([torch.tensor(1.5)], torch.tensor(math.inf), dp_group)
    assert off.skip(5, not_finite=True)["step_loss"] == 3.0  # the step's, not this rank's 1.5


@pytest.mark.parametrize("key, value, message", [
    ("sigma", "-1", "spikes.sigma = -1.0: must be >= 0"),
    ("window", "2", "spikes.window = 2: must be >= 4"),
    ("max_skipped", "0", "spikes.max_skipped = 0: must be >= 1"),
    ("rewind_lr_factor", "0", "spikes.rewind_lr_factor = 0.0: must be in (0, 1]"),
    ("rewind_after", "3", "spikes.rewind_after = 3 rewinds to a checkpoint: set checkpoint.enable = true"),
])
def test_bad_spike_settings_get_one_line(key, value, message):
    import train
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), f"--spikes.{key}", value])
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        train.validate(cfg, 1)


# --- planted in training --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    dump = tmp_path_factory.mktemp("baseline")
    run(dump)
    return dump


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["spike", "nan"])
def test_a_planted_spike_or_nan_is_skipped_and_the_run_goes_on(kind, baseline, tmp_path):
    dump = tmp_path / "run"
    out = run(dump, "--checkpoint.enable", "--checkpoint.interval", 4, "--metrics.enable_tensorboard", plant=f"6:{kind}")
    before, after = at(dump, 6), at(dump, 7)
    assert (after["weights"], after["adam"]) == (before["weights"], before["adam"])  # step 6 moved nothing
    assert at(dump, 6)["weights"] != at(dump, 5)["weights"]  # while step 5 did
    (skip,) = [r for r in records(dump) if "skipped" in r]
    assert skip["step"] == 6 and skip["skipped"] == ("spike" if kind == "spike" else "not finite")
    assert f"skipped step 6: {skip['skipped']}, loss " in out
    if kind == "spike":
        assert skip["step_loss"] > skip["loss_threshold"]
    ours, plain = losses(dump), losses(baseline)
    assert 6 not in ours and len(ours) == 11
    # one update behind the run without the spike: between its loss at the step and at the step before
    assert all(plain[s] < ours[s] < plain[s - 1] + 0.1 for s in range(7, 11)), (ours, plain)
    assert re.search(r"^step: 12  .*  skipped: 1  elapsed", out, re.M), out[-2000:]  # the run's count
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-12", "step-4", "step-8"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(dump / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("skipped_steps")][4:7] == [(5, 0), (6, 1), (7, 1)]  # W&B: alike
    if kind == "spike":
        # a resume from step-4 takes the window with it: the same decision at step 6, the same losses after
        copy_until(dump, tmp_path / "resumed", 4)
        run(tmp_path / "resumed", "--checkpoint.enable", "--checkpoint.interval", 4, plant="6:spike")
        assert losses(tmp_path / "resumed") == {s: v for s, v in ours.items() if s > 4}


@pytest.mark.slow
def test_repeated_spikes_rewind_past_their_data_and_resume_exactly(baseline, tmp_path):
    args = ["--checkpoint.enable", "--checkpoint.interval", 3, "--spikes.rewind_after", 3,
            "--spikes.rewind_within", 10, "--spikes.rewind_lr_factor", 0.5, "--spikes.rewind_lr_steps", 2]
    dump = tmp_path / "run"
    out = run(dump, *args, plant="7:spike,8:spike,9:spike")
    (rewind,) = [r for r in records(dump) if "rewound_to" in r]
    assert (rewind["step"], rewind["rewound_to"], rewind["left_out"]) == (9, 6, [7, 9])
    assert f"rewind at step 9: back to {dump}/checkpoint/step-6; the data of steps 7-9 is left out" in out
    trained = steps(dump)
    again = trained[trained.index(at(dump, 9)) + 1:]  # from the rewind on
    assert [s["step"] for s in again] == [7, 8, 9, 10, 11, 12]
    assert again[0]["weights"] == at(dump, 7)["weights"]  # step-6's weights, and its AdamW state
    # the loader went on from where step 9 left it: the baseline's batches of steps 10-12, then new ones
    assert [s["batch"] for s in again[:3]] == [at(baseline, s)["batch"] for s in (10, 11, 12)]
    assert [s["lr"] for s in again[:3]] == pytest.approx([at(baseline, 7)["lr"] / 2, at(baseline, 8)["lr"] / 2,
                                                         at(baseline, 9)["lr"]])
    # a resume from the step-9 saved after the rewind: the same losses, the rewind's lr cut and counters kept
    copy_until(dump, tmp_path / "resumed", 9)
    run(tmp_path / "resumed", *args)
    assert losses(tmp_path / "resumed") == {s: losses(dump)[s] for s in (10, 11, 12)}
    assert records(tmp_path / "resumed")[-1]["skipped_steps"] == 3


REWIND = ("--checkpoint.enable", "--checkpoint.interval", 4, "--spikes.rewind_after", 2, "--spikes.rewind_within", 10)


@pytest.fixture(scope="module")
def rewound(tmp_path_factory):
    """(dump, output) of a run whose spikes at 7 and 9 rewind it to step-4, with step-8 saved between them."""
    dump = tmp_path_factory.mktemp("rewound")
    return dump, run(dump, *REWIND, plant="7:spike,9:spike")


@pytest.mark.slow
def test_a_rewind_removes_the_later_checkpoints_and_a_restart_after_it_is_exact(rewound, tmp_path):
    dump, out = rewound
    (rewind,) = [r for r in records(dump) if "rewound_to" in r]
    assert (rewind["step"], rewind["rewound_to"], rewind["dropped"]) == (9, 4, [8])
    assert "is left out; step-8 removed; lr x 1" in out and re.search(r"rewinds [\d.]+s, saves [\d.]+s$", out, re.M)
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-12", "step-4", "step-8"]  # step-8 saved anew
    rewound_run = losses(dump)  # each step's last record: after the rewind, the rewound run's

    # A stop at the rewound run's step 6 saves step-6, and the restart resumes there, not at the step-8 the
    # rewind left behind (which would feed the spike's batch again)
    stopped = tmp_path / "stopped"
    run(stopped, *REWIND, plant="7:spike,9:spike,6@2:stop")
    assert sorted(os.listdir(stopped / "checkpoint")) == ["step-4", "step-6"]
    out = run(stopped, *REWIND)
    assert f"resumed from {stopped}/checkpoint/step-6 at step 6" in out
    assert losses(stopped) == rewound_run  # bit for bit

    # A stop at the step where the rewind falls due saves that step; the restart rewinds before it trains
    due = tmp_path / "due"
    run(due, *REWIND, plant="7:spike,9:spike+stop")
    assert sorted(os.listdir(due / "checkpoint")) == ["step-4", "step-8", "step-9"]
    before = len(steps(due))
    run(due, *REWIND)
    assert [s["step"] for s in steps(due)[before:]] == list(range(5, 13))  # not step 10 first, then thrown away
    assert losses(due) == rewound_run
    assert sorted(os.listdir(due / "checkpoint")) == ["step-12", "step-4", "step-8"]

    # The first log line after the rewind covers the steps trained since it, not those it threw away; W&B gets
    # the steps trained again too (its own step may not go back: the training step is a field)
    every5 = tmp_path / "every5"
    wandb = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run(every5, *REWIND, "--metrics.log_freq", 5, "--metrics.enable_wandb", plant="7:spike,9:spike", env=wandb)
    lines = [r for r in records(every5) if "loss" in r]
    assert [r["step"] for r in lines] == [1, 5, 5, 10, 12] and lines[2]["loss"] == rewound_run[5]
    from test_validation import wandb_history
    rows, _ = wandb_history(every5)
    assert [(row["train_step"], row["loss"]) for row in rows if "loss" in row] == [(r["step"], r["loss"]) for r in lines]


def test_a_max_skipped_lowered_on_a_resume_stops_a_run_already_past_it(tmp_path):
    g = guard_after([2.0] * 4, max_skipped=5)
    for step in (5, 6, 7):
        g.check([torch.tensor(50.0)], torch.tensor(1.0), None)
        g.skip(step, not_finite=False)
    checkpointer = types.SimpleNamespace(saver=types.SimpleNamespace(pending=None), folder=str(tmp_path))
    g.stop_if_too_many(7, checkpointer)
    resumed = spikes.SpikeGuard(spikes.Spikes(window=8, max_skipped=2), "cpu")
    resumed.load_state_dict(g.state_dict())
    with pytest.raises(spikes.RunError, match=r"^steps 5-7: 3 steps in a row were skipped \(spikes.max_skipped = 2"):
        resumed.stop_if_too_many(7, checkpointer)


@pytest.mark.slow
def test_fsdp_ranks_skip_together_when_one_rank_spikes(tmp_path):
    run(tmp_path, "--training.local_batch_size", 4, plant="6:spike", nproc=2, plant_rank=1)
    for rank in (0, 1):  # each rank's shard and AdamW state: step 6 moved neither
        assert at(tmp_path, 7, rank)["weights"] == at(tmp_path, 6, rank)["weights"] != at(tmp_path, 5, rank)["weights"]
        assert at(tmp_path, 7, rank)["adam"] == at(tmp_path, 6, rank)["adam"]
    assert [r["step"] for r in records(tmp_path) if "skipped" in r] == [6]


if __name__ == "__main__":
    globals()[os.environ["CHECK"]](sys.argv[1:])
