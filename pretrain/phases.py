"""Phases: a run whose global batch, sequence length and mixture change at given steps, and whose
last phase may anneal, as Llama 3 was pretrained (docs/data.md#phases-and-annealing-llama-3s-recipe).
train.py's [[phases]] tables; the config's own [training] and [[data.sources]] values are phase 0,
and the tables are phases 1, 2, ... in order.

    plan = phases.plan(cfg.phases, training=cfg.training, sources=cfg.data.sources, ...)
    phase = plan.at(step)  # step's phase (1-based steps): its batch, sequence, weights
    plan.tokens_through(n)  # the tokens of steps 1..n, exact across batch and sequence changes
"""

import dataclasses
import math
from dataclasses import dataclass, field

from pretrain.config import ConfigError, unknown


@dataclass
class Phase:  # train.py's [[phases]] tables
    start_step: int = 0  # this phase's first step; 0: start_tokens sets it
    start_tokens: int = 0  # instead of start_step: the first step at or past this many tokens
    global_batch_size: int = 0  # training.global_batch_size from here; 0: the phase before's
    seq_len: int = 0  # training.seq_len from here; 0: the phase before's
    weights: dict = field(default_factory=dict)  # [[data.sources]] weights by name from here (0: off); a source not named keeps the phase before's
    anneal: bool = False  # the last phase only: the lr decays linearly to 0 over its steps


@dataclass(frozen=True)
class Stage:
    """One phase as the run trains it, every value resolved."""
    index: int  # 0: the config's own [training] and [[data.sources]]; then the [[phases]] tables
    first_step: int  # its first step (steps count from 1)
    global_batch_size: int  # sequences per optimizer step
    seq_len: int  # tokens per sequence
    grad_accum: int  # micro-batches per step on each data-parallel rank
    weights: tuple  # each [[data.sources]] source's weight, in their order
    anneal: bool  # its steps decay the lr linearly to 0 (train.lr_factor)
    tokens_before: int  # the tokens of the steps before its first

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


class Plan:
    """The run's phases, resolved: which one a step is in, and the tokens up to a step."""

    def __init__(self, stages: list, names: list):
        self.stages = stages
        self.names = names  # the sources' names, for the resume keys and the log

    def at(self, step: int) -> Stage:
        """The phase of step `step` (1-based; a step before the first counts as phase 0's)."""
        return next(s for s in reversed(self.stages) if s.first_step <= step or s.index == 0)

    def tokens_through(self, n: int) -> int:
        """The tokens of steps 1..n (0 for n = 0)."""
        stage = self.at(n)
        return stage.tokens_before + max(n - stage.first_step + 1, 0) * stage.tokens_per_step

    def source_tokens(self, steps: int) -> list:
        """Each source's tokens in steps 1..steps, by its weight in each phase."""
        out = [0.0] * len(self.names)
        for stage, after in zip(self.stages, self.stages[1:] + [None]):
            last = min(steps, after.first_step - 1 if after else steps)  # its last step
            tokens = max(last - stage.first_step + 1, 0) * stage.tokens_per_step
            out = [n + tokens * w / sum(stage.weights) for n, w in zip(out, stage.weights)]
        return out

    def heaviest(self, training, sizes: dict) -> tuple:
        """(training, sizes) as the phase with the longest sequence has them (a micro-batch's tokens
        are the activations' memory), accumulating if any phase accumulates, of the phases that begin
        within training.steps: what a memory estimate or a dry run checks. training: train.py's
        [training]; sizes: train.validate's."""
        reached = [s for s in self.stages if s.first_step <= training.steps]
        longest = max(reached, key=lambda s: s.seq_len)
        accum = max(s.grad_accum for s in reached)
        return dataclasses.replace(training, seq_len=longest.seq_len), {**sizes, "grad_accum": accum}

    def keys(self) -> list:
        """The [[phases]] as a resume compares them (pretrain/resume_keys.py): a phase that has begun
        may not change; a later one may, or be added. Weights by name, the zero ones left out, so
        that a source appended with weight 0 changes no phase."""
        return [{"phase": s.index, "first_step": s.first_step, "global_batch_size": s.global_batch_size,
                 "seq_len": s.seq_len, "anneal": s.anneal,
                 "weights": {n: w for n, w in zip(self.names, s.weights) if w}}
                for s in self.stages[1:]]

    def describe(self, stage: Stage) -> str:
        """The log line at a phase's first step."""
        total = sum(stage.weights)
        mix = ", ".join(f"{n} {w / total:.2f}" for n, w in zip(self.names, stage.weights) if w)
        anneal = "; the lr anneals linearly to 0 from here" if stage.anneal else ""
        return (f"phase {stage.index} from step {stage.first_step}: global batch "
                f"{stage.global_batch_size} x seq_len {stage.seq_len} = {stage.tokens_per_step:,} "
                f"tokens a step, grad accumulation {stage.grad_accum}; mixture {mix}{anneal}")


def changed_past(saved: list, now: list, step: int) -> list:
    """'phase i key: old -> new' for each change the resume's [[phases]] (`now`, Plan.keys()) make
    to a phase that had begun by `step` in the checkpoint's (`saved`), or would have by now."""
    out = []
    for i in range(max(len(saved), len(now))):
        old = saved[i] if i < len(saved) else None
        new = now[i] if i < len(now) else None
        if not any(p and p["first_step"] <= step for p in (old, new)):
            continue  # it has not begun: a resume may change it, add it or drop it
        if old and new:
            out += [f"phase {i + 1} {k}: {old[k]!r} -> {new[k]!r}" for k in old if old[k] != new[k]]
        else:
            out.append(f"phase {i + 1}: " + (f"begun at step {old['first_step']} -> dropped" if old
                                             else f"none -> begins at step {new['first_step']}"))
    return out


def plan(tables: list, *, training, sources: list, dp: int, streams: int, tp: int,
         max_seq_len: int, global_batch_size: int) -> Plan:
    """The phases of a run, each value checked with one line naming the phase and the key. training:
    train.py's [training] (phase 0's sequence, the local batch, the steps); global_batch_size:
    phase 0's, as train.validate resolved it."""
    names = [s.name for s in sources]
    local = training.local_batch_size
    if sum(s.weight for s in sources) <= 0:
        raise ConfigError("data.sources is empty or its weights sum to 0: "
                          "add [[data.sources]] with a weight > 0")
    stages = [Stage(index=0, first_step=1, global_batch_size=global_batch_size, seq_len=training.seq_len,
                    grad_accum=global_batch_size // (local * dp), weights=tuple(s.weight for s in sources),
                    anneal=False, tokens_before=0)]
    for i, p in enumerate(tables, 1):
        prev = stages[-1]
        where = f"phases: phase {i} (the [[phases]] table number {i})"
        if (p.start_step > 0) == (p.start_tokens > 0) or min(p.start_step, p.start_tokens) < 0:
            raise ConfigError(f"{where}: give start_step or start_tokens, one of them, > 0")
        first = p.start_step
        if p.start_tokens:  # the first step at or past start_tokens, at the batch of the phase before
            first = prev.first_step + math.ceil((p.start_tokens - prev.tokens_before) / prev.tokens_per_step)
        if first <= prev.first_step:
            raise ConfigError(f"{where}: starts at step {first}, not after phase {i - 1}'s first step "
                              f"{prev.first_step}; the phases' starts must increase")
        gbs = p.global_batch_size or prev.global_batch_size
        if gbs < 0 or gbs % (local * dp) or gbs % streams:
            raise ConfigError(f"{where}: global_batch_size = {gbs} must be a multiple of local_batch_size "
                              f"{local} x data-parallel degree {dp} and of data.num_streams {streams}")
        seq = p.seq_len or prev.seq_len
        if not 0 < seq <= max_seq_len or seq % tp:
            raise ConfigError(f"{where}: seq_len = {seq} must be at most the model's max_seq_len "
                              f"{max_seq_len} and divisible by tensor_parallel_degree {tp}")
        weights = list(prev.weights)
        for name, w in p.weights.items():
            if name not in names:
                raise ConfigError(f"{where}: weights: {unknown('source', name, names)}")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
                raise ConfigError(f"{where}: weights.{name} = {w!r} must be a number >= 0")
            weights[names.index(name)] = float(w)
        if sum(weights) <= 0:
            raise ConfigError(f"{where}: its weights sum to 0; give a source a weight > 0")
        if p.anneal and i != len(tables):
            raise ConfigError(f"{where}: anneal = true is for the last phase only")
        tokens_before = prev.tokens_before + (first - prev.first_step) * prev.tokens_per_step
        stages.append(Stage(index=i, first_step=first, global_batch_size=gbs, seq_len=seq,
                            grad_accum=gbs // (local * dp), weights=tuple(weights), anneal=p.anneal,
                            tokens_before=tokens_before))
    return Plan(stages, names)
