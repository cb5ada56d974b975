"""Loss spikes: a step whose loss or gradient norm is far above its recent level, or is not finite,
is skipped, and repeated spikes may rewind the run. train.py's [spikes] section and the guard that
decides, as OLMo-core's SkipStepAdamW does: a step is a spike when its loss or its gradient norm is
above mean + sigma x std of the last `window` kept steps, once half the window is full.

    guard = SpikeGuard(cfg.spikes, device)
    verdict = guard.check(shares, grad_norm, dp_group)  # on the device: no host sync of its own
    ... the step's one all-reduce (pretrain/agreement.py) carries it; then either
    guard.keep()  # after optimizer.step(): the step joins the window
    record = guard.skip(step, not_finite)  # no optimizer.step(): its line, its record
    record = guard.rewind(checkpointer, step, tokens_seen)  # before the next step, once rewind_due()

A skipped step changes neither the weights nor AdamW's state (moments, step count); the data and
the lr schedule go on. The statistics: docs/internals.md#loss-spikes."""

import logging
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from pretrain.checkpoint_folder import newest
from pretrain.config import AT_LEAST_1, NON_NEGATIVE, ConfigError

logger = logging.getLogger("train")


@dataclass
class Spikes:  # train.py's [spikes] section
    sigma: float = 6.0  # skip a step whose loss or grad norm is above mean + sigma x std of the window; 0: skip only non-finite steps
    window: int = 128  # the last this many kept steps; spikes are looked for once half of them are in
    max_skipped: int = 5  # this many skipped steps in a row stop the run (exit 3), naming the last good checkpoint
    rewind_after: int = 0  # this many skips within rewind_within steps reload the newest checkpoint before them, their data left out; 0: never
    rewind_within: int = 100  # the steps over which rewind_after counts skips
    rewind_lr_factor: float = 1.0  # after a rewind the lr is multiplied by this...
    rewind_lr_steps: int = 0  # ...for this many steps
    RULES: ClassVar[dict] = {"sigma": (lambda x: x >= 0, ">= 0 (0 skips only non-finite steps)"),
                             "window": (lambda x: x >= 4, ">= 4 (spikes are looked for once half of it is in)"),
                             "max_skipped": AT_LEAST_1,
                             "rewind_after": (lambda x: x >= 0, ">= 0 (0: never rewind)"),
                             "rewind_lr_factor": (lambda x: 0 < x <= 1, "in (0, 1]"),
                             "rewind_lr_steps": NON_NEGATIVE}


class RunError(RuntimeError):
    """The run had to stop (too many skipped steps in a row): one line, exit 3."""


def check(s: Spikes, checkpoints: bool) -> None:
    """The [spikes] rules across its keys and [checkpoint] (config.check_rules applies RULES),
    before any process group exists; checkpoints: checkpoint.enable."""
    if not s.rewind_within >= max(1, s.rewind_after):  # NaN fails every comparison, so it is caught too
        raise ConfigError(f"spikes.rewind_within = {s.rewind_within!r}: must be >= rewind_after")
    if s.rewind_after and not checkpoints:
        raise ConfigError(f"spikes.rewind_after = {s.rewind_after} rewinds to a checkpoint: "
                          "set checkpoint.enable = true, or rewind_after = 0")


class SpikeGuard:
    """The window of kept steps (on the device), the counters, and any lr cut after a rewind. Every
    rank holds the same: its inputs are all-reduced values, and the decision is the agreed one."""

    def __init__(self, cfg: Spikes, device):
        self.cfg = cfg
        self.values = torch.zeros(2, cfg.window, device=device)  # loss, grad norm; a ring buffer
        self.kept = 0  # kept steps so far: the window holds the last min(kept, window)
        self.in_a_row = 0  # skipped steps since the last kept one
        self.skips = []  # the steps skipped within the last rewind_within steps
        self.skipped = 0  # the run's skipped steps
        self.rewinds = 0  # the run's rewinds
        self.cut_until = 0  # a rewind's lr cut holds up to this step
        self.step_values = self.thresholds = None  # set by the latest check, read only if it skips
        self.reason = ""  # why the latest step was skipped

    def restart_window(self):
        """The window fills afresh (train.begin_phase: a phase's first step is a new loss level)."""
        self.values.zero_()
        self.kept = 0

    def check(self, shares: list, grad_norm: torch.Tensor, group) -> torch.Tensor:
        """(2,) int on the device: [not finite, spike] for this step. shares: this rank's loss shares
        of the step (one per micro-batch); their sum over the dp ranks (`group`; None: this process
        alone) is the step's loss. It is reduced even with sigma 0, where no spike is looked for: the
        window and a skip's record hold the step's loss, so a resume may turn sigma on."""
        loss = torch.stack(shares).sum()
        if group is not None:
            dist.all_reduce(loss, group=group)  # tiny, and no host sync: the agreement waits for it
        x = torch.stack([loss.float(), grad_norm.float()])  # (2,)
        not_finite = ~torch.isfinite(x).all()
        n = min(self.kept, self.cfg.window)
        self.step_values, self.thresholds = x, None
        if not self.cfg.sigma or n < self.cfg.window // 2:
            return torch.stack([not_finite, torch.zeros_like(not_finite)]).int()
        std, mean = torch.std_mean(self.values[:, :n], dim=1)  # (2,) each
        self.thresholds = mean + self.cfg.sigma * std
        return torch.stack([not_finite, (x > self.thresholds).any() & ~not_finite]).int()

    def keep(self):
        """The checked step was applied: it joins the window."""
        self.values[:, self.kept % self.cfg.window] = self.step_values
        self.kept += 1
        self.in_a_row = 0

    def skip(self, step: int, not_finite: bool) -> dict:
        """The checked step was not applied: its metrics record (the log's line). One host read,
        on skipped steps only."""
        self.in_a_row += 1
        self.skipped += 1
        self.skips = [s for s in self.skips if s > step - self.cfg.rewind_within] + [step]
        self.reason = "not finite" if not_finite else "spike"
        loss, grad_norm = self.step_values.tolist()
        record = {"step": step, "skipped": self.reason, "step_loss": loss,
                  "step_grad_norm": grad_norm, "skipped_steps": self.skipped, "sigma": self.cfg.sigma,
                  "time": time.time()}  # slurm/recover.py's goodput counts this step's time as lost
        if self.thresholds is not None:
            record["loss_threshold"], record["grad_norm_threshold"] = self.thresholds.tolist()
        return record

    def stop_if_too_many(self, step: int, checkpointer):
        """RunError once max_skipped steps in a row were skipped, or more (it may be lowered on a
        resume). An async save in flight, of an earlier step, is put in place first: it is good."""
        if self.in_a_row < self.cfg.max_skipped:
            return
        if checkpointer.saver.pending is not None:
            checkpointer.saver.finish()
        raise RunError(f"steps {step - self.in_a_row + 1}-{step}: {self.in_a_row} steps in a row were "
                       f"skipped (spikes.max_skipped = {self.cfg.max_skipped}; the last: {self.reason}); "
                       f"nothing was trained on them. Last good checkpoint: {newest(checkpointer.folder)}")

    def rewind_due(self) -> int:
        """0, or the first step of the cluster of skips that asks for a rewind (rewind_after)."""
        due = self.cfg.rewind_after and len(self.skips) >= self.cfg.rewind_after
        return self.skips[0] if due else 0

    def rewind(self, checkpointer, step: int, tokens_seen: int) -> dict:
        """Repeated spikes (rewind_due): back to the newest complete checkpoint before the first of
        them: its weights, optimizer state, lr schedule and window, while the data loader keeps its
        place, so the batches since that checkpoint are left out, and the checkpoints after it are
        removed. Returns the log's record, with the run's new step and tokens_seen ("rewound_to" is
        `step` itself when there is no checkpoint to go back to)."""
        if checkpointer.saver.pending is not None:  # a save in flight may be the one to go back to
            checkpointer.saver.finish()
        first = self.rewind_due()
        self.skips = []
        before, _ = checkpointer.choose(below=first)
        if before is None:
            return {"step": step, "rewound_to": step, "tokens_seen": tokens_seen,
                    "checkpoint": f"none before step {first}", "time": time.time()}
        path = os.path.join(checkpointer.folder, f"step-{before}")
        to, tokens = checkpointer.load(path, model_only=False, rewind=True)
        dropped = checkpointer.saver.drop_after(to)  # else a restart would resume on the old timeline
        self.in_a_row = 0
        self.rewinds += 1
        self.cut_until = to + self.cfg.rewind_lr_steps
        self.cut_lr(checkpointer.optimizer, to + 1)
        return {"step": step, "rewound_to": to, "tokens_seen": tokens, "checkpoint": path,
                "time": time.time(),  # slurm/recover.py's goodput counts the steps again from here
                "left_out": [to + 1, step], "dropped": dropped, "lr_factor": self.cfg.rewind_lr_factor,
                "lr_steps": self.cfg.rewind_lr_steps, "rewinds": self.rewinds}

    def cut_lr(self, optimizer, step: int):
        """Step `step`'s lr, which the scheduler has just set, times rewind_lr_factor within a
        rewind's cut (the scheduler's own state does not change: a resume re-applies it)."""
        if step <= self.cut_until:
            for group in optimizer.param_groups:
                group["lr"] *= self.cfg.rewind_lr_factor

    def state_dict(self) -> dict:
        return {"values": self.values.tolist(), "kept": self.kept, "in_a_row": self.in_a_row,
                "skips": self.skips, "skipped": self.skipped, "rewinds": self.rewinds,
                "cut_until": self.cut_until}

    def load_state_dict(self, sd: dict, window_only: bool = False):
        """window_only: a rewind takes the checkpoint's window (the statistics before the spikes)
        and keeps the run's counters."""
        if len(sd["values"][0]) == self.cfg.window:  # spikes.window may change on a resume
            self.values.copy_(torch.tensor(sd["values"]))
            self.kept = sd["kept"]
        else:  # a new window fills afresh
            self.values.zero_()
            self.kept = 0
        if not window_only:
            self.in_a_row, self.skips = sd["in_a_row"], sd["skips"]
            self.skipped, self.rewinds, self.cut_until = sd["skipped"], sd["rewinds"], sd["cut_until"]


def line(r: dict) -> str:
    """The log line of a skip's or a rewind's metrics record."""
    if "skipped" in r:
        limits = (f" > the window's mean + {r['sigma']:g} std (loss {r['loss_threshold']:.4f}, "
                  f"grad_norm {r['grad_norm_threshold']:.4f})" if r["skipped"] == "spike" else "")
        return (f"skipped step {r['step']}: {r['skipped']}, loss {r['step_loss']:.4f} grad_norm "
                f"{r['step_grad_norm']:.4f}{limits}; {r['skipped_steps']} skipped so far")
    if "left_out" not in r:
        return f"rewind at step {r['step']}: no checkpoint ({r['checkpoint']}), going on"
    first, end = r["left_out"]
    dropped = "".join(f"; step-{s} removed" for s in r.get("dropped", []))
    return (f"rewind at step {r['step']}: back to {r['checkpoint']}; the data of steps {first}-{end}"
            f" is left out{dropped}; lr x {r['lr_factor']:g} for {r['lr_steps']} steps "
            f"(rewind {r['rewinds']})")
