"""Benchmarks for the trainer's own costs: numbers for the README come from here and from the training log.

    python bench.py overhead --config configs/debug_model.toml   # trainer tokens/s vs a bare fwd/bwd/AdamW loop
    python bench.py startup --config configs/debug_model.toml    # seconds to the first step beyond `import torch`
    python bench.py memory --config configs/llama3_8b.toml --world_size 8   # the start-up memory estimate only
    python bench.py matrix --config configs/debug_model.toml \
        --vary activation_checkpoint.mode=none,full --vary training.local_batch_size=4,8   # one run per combination
    python data.py --config configs/debug_model.toml               # the data loader alone, tokens/s

On one GPU, an 8B-wide model on the bundled data (no network needed), every AC mode with and without compile:

    python bench.py matrix --config configs/debug_model.toml --model.flavor 8B --model.n_layers 8 \
        --training.seq_len 8192 --training.local_batch_size 1 --data.num_streams 1 \
        --training.mixed_precision_param bfloat16 --optimizer.lr 3e-4 \
        --vary activation_checkpoint.mode=none,selective,full --vary compile.enable=false,true

`--nproc 8` runs each combination under `torchrun --standalone --nproc_per_node 8` (e.g. the 8B config).
Extra `--section.key value` arguments go to train.py. Timings on a shared machine are noisy: `overhead`
alternates trainer and bare runs `--repeats` times and compares medians; `matrix` and `overhead` time
only the steps after `--warmup`."""

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.abspath(__file__))


def fail(msg: str):
    """A bad argument or config: one line and exit 2, as train.py does."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def run_trainer(extra: list, steps: int, log_freq: int, nproc: int = 1):
    """train.py for `steps` steps (under torchrun when nproc > 1): (its metrics.jsonl records, its output),
    or (None, output) if it failed."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, *launcher, "train.py", *extra, "--job.dump_folder", dump, "--training.steps", str(steps),
               "--metrics.log_freq", str(log_freq), "--checkpoint.enable", "false"]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            return None, proc.stdout
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], proc.stdout


def steady_tps(records: list, warmup: int) -> float:
    # Each record after the warmup covers the same number of tokens, so the overall rate is the harmonic mean.
    return statistics.harmonic_mean(r["tps"] for r in records if r["step"] > warmup)


def trainer_tps(extra: list, steps: int, warmup: int) -> float:
    """Steady-state tokens/s per process of `python train.py`, from its metrics.jsonl (steps after warmup)."""
    records, out = run_trainer(extra, steps, warmup)
    if records is None:
        sys.exit(f"error: train.py failed:\n{out[-2000:]}")
    return steady_tps(records, warmup)


def bare_tps(cfg, steps: int, warmup: int) -> float:
    """The floor under any trainer: the same model, batch and dtype, with nothing but forward,
    cross-entropy, backward and AdamW on random tokens. No FSDP, data loader, clipping or logging."""
    import torch
    import torch.nn.functional as F
    import train
    from model import Transformer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.training.seed)
    model = Transformer(train.flavor_args(cfg)).to(device)
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
    from model import Transformer
    sizes = train.validate(cfg, args.world_size)
    with torch.device("meta"):  # shapes only: any flavor on any machine
        model = Transformer(train.flavor_args(cfg))
    print(train.format_estimate(train.estimate_memory(model, cfg, sizes, cuda=args.device == "cuda")))


def matrix(args, extra):
    """One trainer run per combination of the --vary values: a markdown table of what its log says."""
    names = [v.partition("=")[0] for v in args.vary]
    choices = [v.partition("=")[2].split(",") for v in args.vary]
    print(f"| {' | '.join(names)} | tps | tflops | mfu | peak memory GiB | allocated GiB | estimate GiB |")
    print("|" + "---|" * (len(names) + 6))
    for combo in itertools.product(*choices):
        overrides = [x for name, value in zip(names, combo) for x in (f"--{name}", value)]
        records, out = run_trainer([*extra, *overrides], args.steps, args.warmup, args.nproc)
        estimate = re.search(r"memory estimate per device: ([\d.]+) GiB", out)
        estimate = estimate.group(1) if estimate else "-"
        if records is None:  # an OOM or a bad combination: say so and go on with the next
            last = next((ln for ln in reversed(out.splitlines()) if ln.strip()), "")
            print(f"| {' | '.join(combo)} | failed: {last[:120]} | | | | | {estimate} |", flush=True)
            continue
        steady = [r for r in records if r["step"] > args.warmup]
        mfu = statistics.mean(r["mfu"] for r in steady) if steady[0]["mfu"] is not None else None
        allocated = max((r["memory_allocated_gib"] or 0) for r in records)
        print(f"| {' | '.join(combo)} | {steady_tps(records, args.warmup):,.0f} | "
              f"{statistics.mean(r['tflops'] for r in steady):.1f} | {f'{mfu:.1f}%' if mfu is not None else 'n/a'} | "
              f"{max(r['memory_gib'] for r in records):.2f} | {f'{allocated:.2f}' if allocated else 'n/a'} | "
              f"{estimate} |", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["overhead", "startup", "memory", "matrix"])
    p.add_argument("--steps", type=int, default=60, help="overhead: steps per run")
    p.add_argument("--warmup", type=int, default=10, help="overhead: untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind")
    p.add_argument("--world_size", type=int, default=1, help="memory: GPUs in the job")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="memory: estimate for this device")
    p.add_argument("--vary", action="append", default=[], metavar="SECTION.KEY=A,B",
                   help="matrix: a config key and its values; several --vary give every combination")
    p.add_argument("--nproc", type=int, default=1, help="matrix: processes per run (torchrun --standalone)")
    a, rest = p.parse_known_args()
    for name in ("warmup", "repeats", "world_size", "nproc"):
        if getattr(a, name) < 1:
            fail(f"--{name} {getattr(a, name)}: must be >= 1")
    if a.what in ("overhead", "matrix") and (a.steps <= a.warmup or a.steps % a.warmup):
        fail("--steps must be a multiple of --warmup and larger than it")
    bad = [v for v in a.vary if not re.fullmatch(r"\w+\.\w+=[^,]+(,[^,]+)*", v)]
    if bad or (a.what == "matrix" and not a.vary):
        fail(f"--vary {bad[0] if bad else '(none given)'}: expected section.key=value1,value2")
    # bench.py sets these itself on every trainer run; a user's value would be silently overridden
    ours = {"training.steps", "metrics.log_freq", "job.dump_folder", "checkpoint.enable"}
    taken = [k for k in [v.partition("=")[0] for v in a.vary] + [x[2:].partition("=")[0] for x in rest] if k in ours]
    if taken:
        fail(f"{taken[0]} is set by bench.py (use --steps and --warmup); leave it out")
    import train
    try:
        {"overhead": overhead, "startup": startup, "memory": memory, "matrix": matrix}[a.what](a, rest)
    except train.ConfigError as e:  # a bad key or value: one line
        fail(str(e))
