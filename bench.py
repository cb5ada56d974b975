"""Benchmarks for the trainer's own costs: numbers for the README come from here and from the training log.

    python bench.py overhead --config configs/debug_model.toml   # trainer tokens/s vs a bare fwd/bwd/AdamW loop
    python bench.py startup --config configs/debug_model.toml    # seconds to the first step beyond `import torch`
    python bench.py memory --config configs/llama3_8b.toml --world_size 8   # the start-up memory estimate only
    python data.py --config configs/debug_model.toml               # the data loader alone, tokens/s

Extra `--section.key value` arguments go to train.py (e.g. `--training.local_batch_size 4`). Each
command prints one summary line at the end. Timings on a shared machine are noisy: `overhead` alternates
trainer and bare runs `--repeats` times and compares medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.abspath(__file__))


def trainer_tps(extra: list, steps: int, warmup: int) -> float:
    """Steady-state tokens/s per process of `python train.py`, from its metrics.jsonl (steps after warmup)."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "train.py", *extra, "--job.dump_folder", dump, "--training.steps", str(steps),
               "--metrics.log_freq", str(warmup), "--checkpoint.enable", "false"]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: train.py failed:\n{proc.stdout[-2000:]}")
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if r["step"] > warmup]
    # Each record covers the same number of tokens, so the overall rate is the harmonic mean.
    return statistics.harmonic_mean(r["tps"] for r in records)


def bare_tps(cfg, steps: int, warmup: int) -> float:
    """The floor under any trainer: the same model, batch and dtype, with nothing but forward,
    cross-entropy, backward and AdamW on random tokens. No FSDP, data loader, clipping or logging."""
    import torch
    import torch.nn.functional as F
    from model import Transformer, flavors

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.training.seed)
    model = Transformer(flavors[cfg.model.flavor]).to(device)
    model.init_weights()
    if cfg.compile.enable:
        for block in model.layers:
            block.compile(fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                                  betas=(cfg.optimizer.beta1, cfg.optimizer.beta2), fused=device.type == "cuda" or None)
    bs, seq = cfg.training.local_batch_size, cfg.training.seq_len
    tokens = torch.randint(0, model.args.vocab_size, (bs, seq + 1), device=device)
    bf16 = cfg.training.mixed_precision_param == "bfloat16"
    for i in range(steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss.item()  # waits for the last step on GPU
    return bs * seq * (steps - warmup) / (time.perf_counter() - t0)


def overhead(args, extra):
    import train
    cfg = train.load_config(extra)
    ours, bare = [], []
    for i in range(args.repeats):
        ours.append(trainer_tps(extra, args.steps, args.warmup))
        bare.append(bare_tps(cfg, args.steps, args.warmup))
        print(f"run {i + 1}: trainer {ours[-1]:,.0f} tokens/s, bare loop {bare[-1]:,.0f} tokens/s", flush=True)
    ratio = statistics.median(ours) / statistics.median(bare)
    print(f"overhead: trainer {statistics.median(ours):,.0f} / bare {statistics.median(bare):,.0f} tokens/s "
          f"= {ratio:.3f} (medians of {args.repeats}, {args.steps - args.warmup} timed steps each)")


def startup(args, extra):
    def wall(cmd):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: {' '.join(cmd[:3])} failed:\n{proc.stdout[-2000:]}")
        return time.perf_counter() - t0

    imports, runs = [], []
    for _ in range(args.repeats):
        imports.append(wall([sys.executable, "-c", "import torch"]))
        with tempfile.TemporaryDirectory() as dump:
            # One step and a clean exit: an upper bound on the time to the first step.
            runs.append(wall([sys.executable, "train.py", *extra, "--job.dump_folder", dump,
                              "--training.steps", "1", "--checkpoint.enable", "false"]))
    imp, run = statistics.median(imports), statistics.median(runs)
    print(f"startup: `import torch` {imp:.2f}s, train.py through step 1 and exit {run:.2f}s: "
          f"{run - imp:.2f}s beyond importing torch (medians of {args.repeats})")


def memory(args, extra):
    import train
    cfg = train.load_config(extra)
    import torch
    from model import Transformer, flavors
    sizes = train.validate(cfg, args.world_size)
    with torch.device("meta"):  # shapes only: any flavor on any machine
        model = Transformer(flavors[cfg.model.flavor])
    print(train.format_estimate(train.estimate_memory(model, cfg, sizes, cuda=args.device == "cuda")))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["overhead", "startup", "memory"])
    p.add_argument("--steps", type=int, default=60, help="overhead: steps per run")
    p.add_argument("--warmup", type=int, default=10, help="overhead: untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind")
    p.add_argument("--world_size", type=int, default=1, help="memory: GPUs in the job")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="memory: estimate for this device")
    a, rest = p.parse_known_args()
    if a.what == "overhead" and (a.steps <= a.warmup or a.steps % a.warmup):
        sys.exit("error: --steps must be a multiple of --warmup and larger than it")
    try:
        {"overhead": overhead, "startup": startup, "memory": memory}[a.what](a, rest)
    except ValueError as e:  # train.ConfigError: a bad key or value, one line
        sys.exit(f"error: {e}")
