"""Where train.py's numbers go. Each log step, validation round and eval round is one record (a flat
dict) that rank 0 sends to the console (torchtitan's log line, so existing parsers work),
metrics.jsonl, TensorBoard and W&B: a new scalar is one more key in the record. Plus the device
figures a record carries: peak memory and the peak FLOP/s that MFU is measured against."""

import json
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain import spikes
from pretrain.memory import peak_resident_bytes
from pretrain.progress import RunClock, duration

logger = logging.getLogger("metrics")

# Dense bf16 peak TFLOP/s per device, matched against torch.cuda.get_device_name (first match wins).
PEAK_TFLOPS = [("GB200", 2500.0), ("B200", 2250.0), ("H100 PCIe", 756.0), ("H100", 989.0),
               ("H200", 989.0), ("H800", 989.0), ("A100", 312.0), ("MI300X", 1307.0), ("MI250X", 191.5)]


def peak_tflops(device, configured: float = 0.0) -> float:
    """For MFU: `configured` (metrics.peak_tflops) if set, else the GPU's; 0 on CPU (MFU prints
    n/a). `device` is a torch.device or a device's name (preflight.py gathers its ranks' names)."""
    if not isinstance(device, str):
        device = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return configured or next((p for key, p in PEAK_TFLOPS if key in device), 0.0)


def memory_stats(device: torch.device):
    """(GiB, % of device, allocated GiB). GPU: the caching allocator's reserved and allocated peaks
    since the last call; CPU: the process's peak RSS since it started (allocated is None)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)
        allocated = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30, 100 * peak / total, allocated / 2**30
    peak = peak_resident_bytes()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return peak / 2**30, 100 * peak / total, None


class LogSums:
    """What the next training log line reports, summed over the steps since the last one (reset()
    after each line, and at a rewind): the kept steps' loss stays on the device until a line reads
    it, and the line reduces the sums over the data-parallel ranks by name."""

    def __init__(self, device, z_loss: bool):
        self.device = device
        self.z_loss = z_loss  # whether the record reports the z term
        self.reset()

    def reset(self):
        self.steps = 0  # steps since the last line, skipped ones too
        self.kept = 0  # the steps applied; the logged loss is their mean
        self.data_seconds = 0.0  # the steps' wait for batches
        self.tokens = 0  # the steps' global batches' positions (a phase may change the batch)
        self.flops = 0.0  # the steps' forward and backward FLOPs, for MFU (flops_per_token)
        self.loss = torch.zeros(2, device=self.device)  # the kept steps' cross-entropy and z-term shares
        self.valid_tokens = torch.zeros((), device=self.device)  # positions the loss counted, every step

    def add(self, loss_shares: list, valid_tokens: torch.Tensor, data_seconds: float, *, kept: bool,
            tokens: int, flops_per_token: float):
        """One step: its (2,) loss share per micro-batch, counted only if the step was applied, and
        its global batch's tokens."""
        self.steps += 1
        self.kept += kept
        self.data_seconds += data_seconds
        self.tokens += tokens
        self.flops += tokens * flops_per_token
        self.valid_tokens += valid_tokens
        for share in loss_shares if kept else ():
            self.loss += share

    def reduce(self, source_tokens: dict, group) -> dict:
        """The record's sums over the dp ranks (`group`), in one all-reduce: the mean loss of the kept
        steps (and z term), the tokens each source gave, and the positions the loss counted."""
        sums = torch.tensor([*source_tokens.values(), 0.0, 0.0], dtype=torch.float64, device=self.device)
        sums[-2:] = self.loss
        dist.all_reduce(sums, group=group)
        ce, z = sums[-2:].tolist()
        valid = self.valid_tokens.item()
        return {"loss": ce / self.kept, **({"z_loss": z / self.kept} if self.z_loss else {}),
                "source_tokens": dict(zip(source_tokens, [int(x) for x in sums[:-2].tolist()])),
                "loss_tokens": int(valid), "loss_tokens_pct": 100 * valid / self.tokens}


def flops_per_token(model, seq_len: int) -> float:
    """Forward and backward: 6 per non-embedding weight, and attention counted in full (PaLM's and
    torchtitan's MFU convention: docs/performance.md#how-to-read-a-figure). model: model.py's."""
    attention = 12 * model.args.n_layers * model.args.dim * seq_len
    return 6 * model.num_params(exclude_embedding=True) + attention


@dataclass
class Throughput:
    """A log line's speed and memory: tokens/s per device, TFLOP/s and MFU (attention counted in
    full, as PaLM and torchtitan count it: docs/performance.md#how-to-read-a-figure)."""
    device: torch.device
    world_size: int
    peak_tflops: float  # per device, for MFU (metrics.peak_tflops); 0 takes the GPU's, if known

    def __post_init__(self):
        self.peak_tflops = peak_tflops(self.device, self.peak_tflops)  # if still 0, MFU is n/a
        memory_stats(self.device)  # reset the GPU's peak: the first line covers training only

    def over(self, sums: LogSums, seconds: float) -> dict:
        """The figures of sums' steps, which trained for `seconds`."""
        tps = sums.tokens / seconds / self.world_size
        tflops = sums.flops / seconds / self.world_size / 1e12
        gib, pct, allocated = memory_stats(self.device)
        return {"memory_gib": gib, "memory_pct": pct, "memory_allocated_gib": allocated, "tps": tps,
                "tflops": tflops, "mfu": 100 * tflops / self.peak_tflops if self.peak_tflops else None,
                "data_wait_pct": 100 * sums.data_seconds / seconds}


class MetricsLogger:
    """Rank 0 sends each record where the module's docstring says; other ranks drop everything."""

    HIDDEN = {"step", "tokens_seen", "source_tokens", "memory_allocated_gib", "memory_pct",
              "validation_tokens", "loss_tokens", "loss_tokens_pct", "eval_examples", "time",
              "elapsed_seconds", "eta_seconds", "skipped_steps", "phase"}

    def __init__(self, cfg, dump: str, rank: int, clock: RunClock, config: dict):
        """cfg: train.py's [metrics] section; config: the whole config's values, for W&B."""
        self.clock = clock
        self.last = {}  # the latest value of each key logged, for the summary line
        self.peak = {"memory_gib": 0.0, "memory_allocated_gib": 0.0}  # the largest logged
        self.jsonl = self.tb = self.wandb = None
        if rank != 0:
            return
        self.jsonl = open(os.path.join(dump, "metrics.jsonl"), "a")
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(dump, "tb"))
        if cfg.enable_wandb:
            import wandb  # optional: imported only when enabled
            id_file = os.path.join(dump, "wandb_run_id")  # a resumed run continues the same W&B run
            run_id = open(id_file).read().strip() if os.path.exists(id_file) else os.urandom(4).hex()
            with open(id_file, "w") as f:
                f.write(run_id)
            name = (cfg.wandb_run_name or os.environ.get("WANDB_RUN_NAME")
                    or os.path.basename(os.path.abspath(dump)))
            project = cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "llama3-pretrain"
            self.wandb = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=dump,
                                    config=config)
            # The training step is a field, the x-axis: W&B's own step must grow, and would drop the
            # steps a rewind, or a resume from an older checkpoint, trains again.
            self.wandb.define_metric("train_step")
            self.wandb.define_metric("*", step_metric="train_step")

    def log(self, r: dict):
        if self.jsonl is None:
            return
        if "loss" in r:  # a training step, in torchtitan's format so existing log parsers work
            # when it ended (unix s), for the job's goodput (slurm/recover.py)
            r = {**r, "time": time.time(), **self.clock.times(r["step"])}
            mfu = f"{r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            line = (f"step: {r['step']}  loss: {r['loss']:.4f}  grad_norm: {r['grad_norm']:.4f}  "
                    f"lr: {r['lr']:.1e}  memory: {r['memory_gib']:.2f}GiB({r['memory_pct']:.1f}%)  "
                    f"tps: {r['tps']:,.0f}  tflops: {r['tflops']:.1f}  mfu: {mfu}  "
                    f"data_wait: {r['data_wait_pct']:.1f}%")
            if r.get("loss_tokens_pct", 100) < 100:  # block_causal keeps boundaries out of the loss
                line += f"  loss_tokens: {r['loss_tokens_pct']:.1f}%"
            if r.get("phase"):  # [[phases]] after the first (pretrain/phases.py)
                line += f"  phase: {r['phase']}"
            if r.get("skipped_steps"):  # the run's skipped steps so far (pretrain/spikes.py)
                line += f"  skipped: {r['skipped_steps']}"
            for k in self.peak:
                self.peak[k] = max(self.peak[k], r[k] or 0.0)
            line += f"  elapsed {duration(r['elapsed_seconds'])}  eta {duration(r['eta_seconds'])}"
            shown = {"loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu", "data_wait_pct"}
        elif "skipped" in r or "rewound_to" in r:  # a skipped step, a rewind
            line, shown = spikes.line(r), set(r)
        elif "eval_acc" in r:  # an [eval] round (evals.py): acc/acc_norm per task
            norm = r["eval_acc_norm"]
            per = "  ".join(f"{k} {v:.4f}/{norm[k]:.4f}" for k, v in r["eval_acc"].items())
            examples = ", ".join(map(str, r["eval_examples"].values()))
            line = (f"eval: step {r['step']}  acc/acc_norm  {per}  ({examples} examples)  "
                    f"{r['eval_seconds']:.1f}s")
            shown = {"eval_acc", "eval_acc_norm", "eval_seconds"}
        else:  # a validation round
            per = ", ".join(f"{k} {v:.4f}" for k, v in r["validation_source_loss"].items())
            ppl = math.exp(min(r["validation_loss"], 50))
            line = (f"validate: step {r['step']}  loss {r['validation_loss']:.4f}  ppl {ppl:.2f}  "
                    f"({per})  {r['validation_tokens']:,} tokens  {r['validation_seconds']:.1f}s")
            shown = {"validation_loss", "validation_source_loss", "validation_seconds"}
        numbers = {k: v for k, v in r.items() if isinstance(v, (int, float))}
        extra = [f"{k}: {v:.4g}" for k, v in numbers.items() if k not in shown | self.HIDDEN]
        logger.info("  ".join([line, *extra]))
        self.last.update(r)
        self.jsonl.write(json.dumps(r) + "\n")
        self.jsonl.flush()
        scalars = {}  # TensorBoard and W&B plot the numbers, a nested dict's as "key/name"
        for k, v in r.items():
            for n, x in v.items() if isinstance(v, dict) else [("", v)]:
                if k not in ("step", "time") and isinstance(x, (int, float)):
                    scalars[f"{k}/{n}" if n else k] = x
        if self.tb:
            for k, x in scalars.items():
                self.tb.add_scalar(k, x, r["step"])
        if self.wandb:
            self.wandb.log({**scalars, "train_step": r["step"]})

    def summary(self):
        """The end of a run: peak memory; steps, tokens, wall time, the last losses, the rounds' time."""
        if self.jsonl is None or "loss" not in self.last:
            return
        last = self.last
        validation = f", validation {last['validation_loss']:.4f}" if "validation_loss" in last else ""
        gib, allocated = self.peak["memory_gib"], self.peak["memory_allocated_gib"]
        gpu = f"{allocated:.2f} GiB allocated, {gib:.2f} GiB reserved"  # a host shows RSS instead
        logger.info(f"memory: peak {gpu if allocated else f'{gib:.2f} GiB RSS'}")
        logger.info(f"done: step {last['step']}, {last['tokens_seen']:,} tokens, "
                    f"{duration(self.clock.now() - self.clock.start)} wall; loss {last['loss']:.4f}"
                    f"{validation}; {self.clock.rounds()}")

    def close(self):
        for sink in (self.jsonl, self.tb):
            if sink:
                sink.close()
        if self.wandb:
            self.wandb.finish()
