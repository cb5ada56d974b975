"""Optimizers beside torch's, and train.py's [optimizer] section: AdamW with its moments in bf16 (Muon:
pretrain/muon.py); the lr schedule at a resume's position. train.build_optimizer() chooses among
torch's and these."""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from pretrain.config import NON_NEGATIVE, POSITIVE, ConfigError, one_of


@dataclass
class Optimizer:  # train.py's [optimizer] section
    name: str = "AdamW"  # AdamW, or Muon: the blocks' matrices take Muon ([muon]), the rest AdamW (build_optimizer() is the place to add another)
    lr: float = 8e-4  # peak learning rate
    beta1: float = 0.9  # Adam beta1
    beta2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled weight decay (applied to every weight, Muon's too)
    state_dtype: str = "float32"  # AdamW's two moments and Muon's momentum: float32, or bfloat16 (half the bytes; the update stays fp32; beta2 <= 0.99)
    RULES: ClassVar[dict] = {"name": one_of("AdamW", "Muon"), "lr": POSITIVE,
                             "beta1": (lambda x: 0 <= x < 1, "in [0, 1)"),
                             "beta2": (lambda x: 0 <= x < 1, "in [0, 1)"),
                             "eps": POSITIVE, "weight_decay": NON_NEGATIVE,
                             "state_dtype": one_of("float32", "bfloat16")}


def check(o) -> None:
    """[optimizer]'s rules that concern these optimizers, before any process group exists. o: the
    section."""
    if o.state_dtype == "bfloat16" and o.beta2 > AdamWBF16State.MAX_BETA2:
        raise ConfigError(f"optimizer.beta2 = {o.beta2:g} with state_dtype = \"bfloat16\": a bf16 "
                          f"exp_avg_sq cannot decay by 1 - beta2 = {1 - o.beta2:.2g} a step (the rounding "
                          "undoes it), so the lr would fall silently; use beta2 <= "
                          f"{AdamWBF16State.MAX_BETA2} or state_dtype = \"float32\"")


def set_schedule(scheduler, optimizer, position: int):
    """The lr schedule (a LambdaLR) at `position`, the steps it has taken, with this run's peak lr
    and shape: a resume takes only the position from a checkpoint, ours or torchtitan's, since
    optimizer.lr, [lr_scheduler] and training.steps may change. LambdaLR's own load_state_dict
    would bring back the saved base_lrs and the lr last set."""
    lrs = [base * f(position) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    at = {"last_epoch": position, "_step_count": position + 1, "_last_lr": lrs}
    scheduler.load_state_dict({**scheduler.state_dict(), **at})
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


class AdamWBF16State(torch.optim.Optimizer):
    """torch.optim.AdamW's update with its two moments stored in bf16: 4 bytes a parameter instead of
    8. Each parameter's moments are read up to fp32, updated, applied and rounded back in turn, so
    the fp32 copies exist for one parameter at a time (torch's fused AdamW wants one dtype).

    Rounding to bf16 (8 significant bits) undoes a decay by beta2 smaller than about half its spacing,
    so with beta2 close to 1 a moment that gets no more gradient stays where it was. Up to MAX_BETA2
    it decays as fp32's does, within the rounding; check() refuses more (docs/internals.md#parallelism
    has the measurements)."""

    MAX_BETA2 = 0.99

    def __init__(self, params, lr: float, betas: tuple, eps: float, weight_decay: float):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)  # it casts the moments to the weights' dtype; undo that
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:  # "step" lives on the host, as torch's AdamW keeps it off CUDA graphs
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = state["step"].item()
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2)
                exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
                p.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
