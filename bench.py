"""Measurements, not training: numbers for the README come from here and from the training log.

    python bench.py overhead --config configs/debug_model.toml  # tokens/s: trainer vs a bare loop
    python bench.py startup --config configs/debug_model.toml   # start-up, beyond `import torch`
    python bench.py memory --config configs/llama3_8b.toml --world_size 8  # fits an H100/H200?
    python bench.py matrix --config configs/debug_model.toml --vary training.local_batch_size=4,8 \
        --vary activation_checkpoint.mode=none,full  # a run per combination; --nproc 8: torchrun
    python bench.py titan --config configs/debug_model.toml --training.seq_len 512  # vs torchtitan
    python bench.py mask --config configs/debug_model.toml    # block_causal vs causal: tokens/s
    python bench.py loader --config configs/debug_model.toml  # the loader alone: shares, tokens/s
    python bench.py gpu --out DIR  # GPU node: self-test, tokens/s, MFU, memory into DIR/summary.md
    python bench.py profile --config configs/debug_model.toml --out DIR  # top kernels, idle gaps

`python bench.py WHAT --help` lists each one's options; other `--section.key value` arguments go to
train.py's config. Timings on a shared machine are noisy: `overhead`, `titan` and `mask` alternate
their two sides `--repeats` times and report medians and the load average; only the steps after
`--warmup` count."""

import argparse
import dataclasses
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from pretrain import measure
from pretrain import memory
from pretrain import titan_run

ROOT = os.path.dirname(os.path.abspath(__file__))


def fail(msg: str):
    """A bad argument or config: one line and exit 2, as train.py does."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def planned(extra: list, world_size: int, gpu: bool | None = None):
    """The config, train.validate's sizes and a meta-device model (shapes only: any flavor on any
    machine) with the vocabulary the run will have (train.model_args). gpu: train.validate's."""
    import torch
    import train
    from model import Transformer
    cfg = train.load_config(extra)
    sizes = train.validate(cfg, world_size, gpu)
    with torch.device("meta"):
        return cfg, Transformer(train.model_args(cfg)), sizes


def estimated(cfg, model, sizes: dict, cuda: bool) -> dict:
    """memory.estimate_memory for this config: the sections it reads, handed by name."""
    f8_gather = "float8" in cfg.model.converters and cfg.float8.enable_fsdp_float8_all_gather
    return memory.estimate_memory(model, sizes, training=cfg.training, optimizer=cfg.optimizer,
                                  activation_checkpoint=cfg.activation_checkpoint, float8_gather=f8_gather, cuda=cuda)


def estimate(args, extra):  # bench.py memory
    import train
    if args.world_size is None and train.load_config(extra).model.flavor != "debugmodel":
        fail("--world_size is missing: the number of GPUs in the job (e.g. --world_size 8); "
             "it sets the sharding")
    cfg, model, sizes = planned(extra, args.world_size or 1, gpu=args.device == "cuda")  # the job's
    training, sizes = sizes["phases"].heaviest(cfg.training, sizes)  # of [[phases]], the longest sequence's
    parts = estimated(dataclasses.replace(cfg, training=training), model, sizes, cuda=args.device == "cuda")
    print(memory.format_estimate(parts))
    for name, capacity in memory.GPUS if args.device == "cuda" else []:
        share = parts["total"] / capacity
        verdict = memory.verdict(parts["total"], capacity)
        print(f"{name}: {verdict} ({100 * share:.0f}% of its memory)")


# --- timings

def run_trainer(extra: list, steps: int, log_freq: int, nproc: int = 1, timeout: float = None):
    """train.py for `steps` steps (under torchrun when nproc > 1): (its metrics.jsonl records, its
    output), or (None, output) if it failed or ran past `timeout` seconds."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    launcher = [] if nproc == 1 else torchrun
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, *launcher, "train.py", *extra, "--job.dump_folder", dump,
               "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
               "--checkpoint.enable", "false", "--validation.enable", "false"]
        status, out = measure.run_command(cmd, timeout)
        if status != 0:
            return None, out
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "loss" in r], out  # training steps only


def trainer_tps(extra: list, args, nproc: int = 1) -> float:
    """Steady-state tokens/s per process of train.py: its metrics.jsonl's steps after the warmup."""
    records, out = run_trainer(extra, args.steps, args.warmup, nproc)
    if not records:
        sys.exit(f"error: train.py failed:\n{out[-2000:]}")
    return measure.steady_tps(records, args.warmup)


def bare_tps(cfg, steps: int, warmup: int) -> float:
    """The floor under any trainer: the same model, batch and dtype with nothing but forward,
    cross-entropy, backward and AdamW on random tokens; no FSDP, data loader, clipping, logging."""
    import torch
    import torch.nn.functional as F
    import train
    from model import Transformer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.training.seed)
    model = Transformer(train.model_args(cfg)).to(device)
    model.init_weights()
    if cfg.compile.enable:
        for block in model.layers:
            block.compile(fullgraph=True)
    optimizer, _ = train.build_optimizer(model, cfg, device)  # the trainer's AdamW, fused as there
    bs = cfg.training.local_batch_size
    seq = cfg.training.seq_len
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
    measure.side_by_side({"trainer": lambda: trainer_tps(extra, args),
                          "bare loop": lambda: bare_tps(cfg, args.steps, args.warmup)}, args.repeats)


def mask(args, extra):
    """Document masking's cost: the trainer with block_causal and with causal attention, in turn."""
    block_causal = [*extra, "--model.attn_mask_type", "block_causal"]
    causal = [*extra, "--model.attn_mask_type", "causal"]
    measure.side_by_side({"block_causal": lambda: trainer_tps(block_causal, args, args.nproc),
                          "causal": lambda: trainer_tps(causal, args, args.nproc)}, args.repeats)


def startup(args, extra):
    """Launch to the first metrics.jsonl line (step 1, a small batch), beyond `import torch`."""
    def wall(cmd, log=""):
        """Seconds until `log` has a line (or the process ends); output to a file, not a pipe."""
        with tempfile.TemporaryFile("w+") as out:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            while proc.poll() is None and not (log and os.path.exists(log) and os.path.getsize(log)):
                time.sleep(0.005)
            t = time.perf_counter() - t0
            if proc.wait():
                out.seek(0)
                sys.exit(f"error: {' '.join(cmd[:3])} failed:\n{out.read()[-2000:]}")
            return t

    small = ["--training.local_batch_size", "2", "--training.seq_len", "64",
             "--validation.enable", "false"]  # before the user's flags: they may change it
    once = ["--training.steps", "1", "--checkpoint.enable", "false"]
    imports = []
    runs = []
    for _ in range(args.repeats):
        imports.append(wall([sys.executable, "-c", "import torch"]))
        with tempfile.TemporaryDirectory() as dump:
            cmd = [sys.executable, "train.py", *small, *extra, "--job.dump_folder", dump, *once]
            runs.append(wall(cmd, f"{dump}/metrics.jsonl"))
    imp = statistics.median(imports)
    run = statistics.median(runs)
    load = os.getloadavg()[0]
    print(f"startup: `import torch` {imp:.2f}s, train.py to its first metrics.jsonl line "
          f"{run:.2f}s: {run - imp:.2f}s beyond importing torch (medians of {args.repeats}; "
          f"load average {load:.2f})")


def loader(args, extra):
    """The data loader alone, one stream, as train.py configures it: the mixture's realised token
    shares and tokens/s, or --show K packed samples decoded."""
    import torch  # noqa: F401  (the first batch would import it, and be timed with it)
    import train
    from data import DataLoader, Tokenizer
    from pretrain.data_manifest import pinned_manifest
    cfg = train.load_config(extra)
    train.validate(cfg, world_size=1)
    d = cfg.data
    timeout = d.hub_timeout_seconds
    budget = cfg.comm.init_timeout_seconds  # as train.py's reads retry
    manifest = pinned_manifest(d.manifest, "", d.sources, [], timeout, budget) if d.manifest else None
    tok = Tokenizer(cfg.model.tokenizer_path)
    data = DataLoader(d.sources, tok, cfg.training.seq_len, cfg.training.local_batch_size, 0, 1,
                      num_streams=1, seed=d.seed, num_workers=d.num_workers, manifest=manifest,
                      timeout=timeout, budget=budget)  # rank 0 of 1, one stream
    try:
        for i in range(args.show):
            x, _ = next(data)
            print(f"--- sample {i} ({x.shape[1]} tokens) ---")
            print(tok.decode(x[0].tolist()))
        if args.show:
            return
        t0 = time.perf_counter()
        next(data)  # the first batch pays for starting workers and opening files: timed on its own
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = 0
        while n < args.tokens:
            n += next(data)[0].numel()
        dt = time.perf_counter() - t0
    finally:
        data.close()
    counts = data.source_tokens()
    weights = sum(s.weight for s in d.sources)
    for s in d.sources:
        share = counts[s.name] / sum(counts.values())
        weight = s.weight / weights
        tokens = f"{counts[s.name]:>10,} tokens"
        print(f"{s.name:>16}: {tokens}  share {share:6.2%}  (weight {weight:6.2%})")
    workers = f"{d.num_workers} worker(s)" if d.num_workers else "no workers"
    print(f"loader: {n:,} tokens in {dt:.2f}s = {n / dt:,.0f} tokens/s after a first batch in "
          f"{first:.2f}s (one stream, {workers})")


def matrix_row(extra: list, steps: int, warmup: int, nproc: int, cuda: bool, timeout: float = None):
    """One trainer run and `bench.py memory`'s estimate for it: (a matrix row's cells: tokens/s,
    TFLOP/s, MFU, peak memory, peak allocated and estimate in GiB; the run's output). A failed run's
    row says why."""
    import train
    try:  # what `bench.py memory` says for this run
        cfg, model, sizes = planned(extra, nproc)
        parts = estimated(cfg, model, sizes, cuda=cuda)
        estimate = f"{parts['total'] / 2**30:.2f}"
    except train.ConfigError:  # train.py says why in the row
        estimate = "-"
    records, out = run_trainer(extra, steps, warmup, nproc, timeout)
    if records is None:  # an OOM or a bad combination: say so and go on with the next
        last = next((ln for ln in reversed(out.splitlines()) if ln.strip()), "")
        return [f"failed: {last[:120]}", "", "", "", "", estimate], out
    steady = [r for r in records if r["step"] > warmup]
    tflops = statistics.mean(r["tflops"] for r in steady)
    mfu = statistics.mean(r["mfu"] for r in steady) if steady[0]["mfu"] is not None else None
    peak = max(r["memory_gib"] for r in records)
    allocated = max((r["memory_allocated_gib"] or 0) for r in records)
    return [f"{measure.steady_tps(records, warmup):,.0f}", f"{tflops:.1f}",
            f"{mfu:.1f}%" if mfu is not None else "n/a", f"{peak:.2f}",
            f"{allocated:.2f}" if allocated else "n/a", estimate], out


PADDED = " padded from the bundled tokenizer's (Llama 3's step and memory, not its loss)"


def meta_vocabulary(extra: list, device: str) -> list:
    """On a GPU the runs train Meta's vocabulary unless --model.tokenizer_path or vocab_size says otherwise;
    without llama-models, Llama 3's size padded (a GPU's start is not lost to a missing wheel)."""
    if device != "cuda" or {"--model.tokenizer_path", "--model.vocab_size"} & set(extra):
        return []
    path = measure.meta_tokenizer()
    if path:
        return ["--model.tokenizer_path", path]
    print(f"no Llama 3 tokenizer (pip install llama-models==0.3.0): vocabulary 128,256{PADDED}", flush=True)
    return ["--model.vocab_size", "128256"]


def matrix(args, extra):
    """One trainer run per combination of the --vary values: a markdown table of what logs say."""
    import torch
    extra = [*meta_vocabulary(extra, "cuda" if torch.cuda.is_available() else "cpu"), *extra]
    names = [v.partition("=")[0] for v in args.vary]
    choices = [v.partition("=")[2].split(",") for v in args.vary]
    columns = "tps | tflops | mfu | peak memory GiB | allocated GiB | estimate GiB"
    print(f"| {' | '.join(names)} | {columns} |")
    print("|" + "---|" * (len(names) + 6))
    cuda = torch.cuda.is_available()
    for combo in itertools.product(*choices):
        overrides = [x for name, value in zip(names, combo) for x in (f"--{name}", value)]
        cells, _ = matrix_row([*extra, *overrides], args.steps, args.warmup, args.nproc, cuda)
        print(f"| {' | '.join([*combo, *cells])} |", flush=True)


# --- bench.py gpu: one command for a GPU node, every figure into one markdown file

# Per device, the settings every `bench.py gpu` run shares: on a GPU the real shapes; on a CPU tiny
# ones (the debug model for 1B and the 8B width; fp32, eager), so the code meeting the GPU ran here.
GPU_SHAPES = {
    "cuda": {"small": "1B", "wide": "8B", "steps": 20, "warmup": 10,
             "flags": ["--training.seq_len", "8192", "--training.local_batch_size", "1",
                       "--training.mixed_precision_param", "bfloat16", "--compile.enable", "true"]},
    "cpu": {"small": "debugmodel", "wide": "debugmodel", "steps": 3, "warmup": 1,
            "flags": ["--training.seq_len", "64", "--training.local_batch_size", "2"]},
}
# One stream: a batch of 1 per step. lr 3e-4: the debug config's 3e-3 spikes a wide model's loss.
GPU_SHARED = ["--activation_checkpoint.mode", "selective", "--data.num_streams", "1",
              "--optimizer.lr", "3e-4"]
# --device cpu: a pretend device, so the estimate picks the blocks as it does on a GPU
CPU_CAPACITY = 80 * 2**20
# Seconds a step needs (the first H100 run's, docs/performance.md#one-h100, with room; the self-test's
# two compiled Muon runs and 8B-full-ac are guesses): a step is skipped where the budget left is less,
# and stopped at the budget's end or, on a GPU, twice this.
STEP_SECONDS = {"cuda": {"self-test": 150, "1B": 40, "8B": 80, "8B-lean": 120},
                "cpu": {"self-test": 60, "1B": 30, "8B": 30, "8B-lean": 30}}
# The leanest layout one GPU trains: bf16 optimizer states and full AC (all of 8B's blocks fit an H200)
LEAN = ["--optimizer.state_dtype", "bfloat16", "--activation_checkpoint.mode", "full"]


def gpu_plan(shape: dict, blocks: int, lean_blocks: int) -> list:
    """(name, kind, train.py flags) of each step after the self-test: the 1B flavor, then the 8B
    width with `blocks` blocks: bf16, float8 rowwise (torchao's small layers in bf16), tensorwise
    (its settings are FSDP's, and one GPU does not shard), block-causal attention and Muon; last,
    LEAN with `lean_blocks` blocks."""
    wide = ["--model.flavor", shape["wide"], "--model.n_layers", str(blocks)]
    lean = ["--model.flavor", shape["wide"], "--model.n_layers", str(lean_blocks)]
    float8 = [*wide, "--model.converters", "float8", "--float8.recipe_name"]
    small = ["--float8.filter_fqns", "output,auto_filter_small_kn"]  # torchao's table of sizes
    return [("self-test", "self-test", []),
            ("1B", "1B", ["--model.flavor", shape["small"]]),
            ("8B-wide", "8B", wide),
            ("8B-wide-float8-rowwise", "8B", [*float8, "rowwise", *small]),
            ("8B-wide-float8-tensorwise", "8B", [*float8, "tensorwise"]),
            ("8B-wide-block-causal", "8B", [*wide, "--model.attn_mask_type", "block_causal"]),
            ("8B-wide-muon", "8B", [*wide, "--optimizer.name", "Muon"]),  # its step beside AdamW's (8B-wide)
            ("8B-full-ac", "8B-lean", [*lean, *LEAN])]


def device_memory(device: str) -> tuple:
    """(the device's name, the bytes a run's estimate must fit in). A child process asks the GPU: a
    CUDA context in this process would hold memory the runs need."""
    if device == "cpu":
        name = f"CPU (tiny shapes; a pretend device of {CPU_CAPACITY / 2**20:.0f} MiB)"
        return name, CPU_CAPACITY
    query = "import torch; p = torch.cuda.get_device_properties(0); print(p.total_memory, p.name)"
    status, out = measure.run_command([sys.executable, "-c", query])
    if status != 0:
        fail(f"--device cuda: no GPU visible ({out.strip()[-200:]}); "
             "--device cpu runs the same steps at tiny shapes")
    total, name = out.strip().splitlines()[-1].split(maxsplit=1)  # after any warning torch printed
    return name, int(total)


def blocks_that_fit(extra: list, capacity: int) -> int:
    """The most blocks of the flavor's width, up to its count or [model] n_layers, whose estimate
    fits `capacity` with the allocator's margin (memory.verdict "fits"); at least 1. A bisection:
    the estimate grows with the blocks."""
    import train

    # shapes only (cuda=True): on a CPU the process's own memory is no block's
    def fits(n: int) -> bool:
        cfg, model, sizes = planned([*extra, "--model.n_layers", str(n)], 1)
        total = estimated(cfg, model, sizes, cuda=True)["total"]
        return memory.verdict(total, capacity) == "fits"

    lo, hi = 1, train.flavor_args(train.load_config(extra)).n_layers  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def describe(cfg, model) -> str:
    """A run, for its summary row: shape, vocabulary, tokens per step, precision, compile, AC,
    float8, an optimizer other than AdamW, bf16 optimizer states, mask."""
    t = cfg.training
    a = model.args
    what = [f"{cfg.model.flavor} width, {a.n_layers} blocks", f"vocab {a.vocab_size:,}",
            f"seq {t.seq_len:,} x {t.local_batch_size}",
            "bf16" if t.mixed_precision_param == "bfloat16" else "fp32",
            "compile" if cfg.compile.enable else "eager", f"AC {cfg.activation_checkpoint.mode}"]
    if "float8" in cfg.model.converters:  # and whether torchao's table keeps small layers in bf16
        auto = ", small layers bf16" if "auto_filter_small_kn" in cfg.float8.filter_fqns else ""
        what.append(f"float8 {cfg.float8.recipe_name}{auto}")
    what += [cfg.optimizer.name] if cfg.optimizer.name != "AdamW" else []
    what += ["bf16 optimizer states"] if cfg.optimizer.state_dtype == "bfloat16" else []
    return ", ".join([*what, a.attn_mask_type])


def self_test(timeout: float) -> tuple:
    """`pytest -m gpu`, the CUDA twins of the CPU tests: (its row's cell, its output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--continue-on-collection-errors"]
    status, out = measure.run_command(cmd, timeout)
    # pytest's last line: "8 passed, 1 failed in 95.2s"
    counts = re.findall(r"^=*\s*(\d+ [a-z]+\b.* in [\d.]+s\b.*?)\s*=*$", out, re.M)
    result = counts[-1] if counts else (out.strip().splitlines() or [""])[-1][:120]
    verdict = {0: "passed", None: f"stopped at {timeout:.0f} s"}.get(status, "FAILED")
    return [f"`pytest -m gpu` {verdict}: {result}"], out


def append(path: str, line: str, mode: str = "a"):
    """A line of the summary, on disk at once: a kill at the machine's time limit keeps the rows."""
    print(line, flush=True)
    with open(path, mode) as f:
        f.write(line + "\n")


def summary_header(name: str, args, shared: list, shape: dict, blocks: int, capacity: int) -> list:
    """summary.md's first lines: where and what ran, the settings all runs share, the table head."""
    import torch
    vocab = f"{planned(shared, 1)[1].args.vocab_size:,} words" + PADDED * ("--model.vocab_size" in shared)
    cuda = f", CUDA {torch.version.cuda}" if args.device == "cuda" else ""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return [f"# bench.py gpu: {name}", "",
            f"torch {torch.__version__}{cuda}, Python {sys.version.split()[0]}, {when}, "
            f"budget {args.budget:.0f} s.",
            f"Command: `python bench.py {' '.join(sys.argv[1:])}`.",
            f"Every run: `{' '.join(shared)}`, {shape['steps']} steps, the first {shape['warmup']} "
            f"untimed; PYTORCH_ALLOC_CONF={os.environ.get('PYTORCH_ALLOC_CONF', '')}.",
            f"Vocabulary {vocab}. The {shape['wide']} width: {blocks} blocks fit "
            f"{capacity / 2**30:.1f} GiB by the estimate ({memory.FREE:.0%} kept free).",
            "MFU counts attention in full (PaLM's, torchtitan's). Each step's log: `<step>.log` here.", "",
            "| step | what ran | tokens/s | TFLOP/s | MFU | peak memory GiB | peak allocated GiB "
            "| estimate GiB | seconds |",
            "|---|---|---|---|---|---|---|---|---|"]


def gpu(args, extra):
    """The GPU self-test, then tokens/s, MFU, peak memory and the estimate of each run of gpu_plan:
    each step appends its row to DIR/summary.md as it ends, and its output to DIR/<step>.log."""
    import train
    deadline = time.monotonic() + args.budget
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # train.py and the tests take a GPU they see
    else:  # as torchtitan's runs: less fragmentation on a GPU the estimate fills
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    name, capacity = device_memory(args.device)
    shape = GPU_SHAPES[args.device]
    config = [] if "--config" in extra else ["--config", "configs/debug_model.toml"]  # offline data
    shared = [*config, *shape["flags"], *GPU_SHARED, *meta_vocabulary(extra, args.device), *extra]
    blocks = blocks_that_fit([*shared, "--model.flavor", shape["wide"]], capacity)
    lean_blocks = blocks_that_fit([*shared, "--model.flavor", shape["wide"], *LEAN], capacity)
    plan = gpu_plan(shape, blocks, lean_blocks)
    steps = [step for step, _, _ in plan]
    if set(args.only or []) - set(steps):
        fail(f"--only {','.join(args.only)}: the steps are {', '.join(steps)}")
    os.makedirs(args.out, exist_ok=True)
    summary = os.path.join(args.out, "summary.md")
    header = summary_header(name, args, shared, shape, blocks, capacity)
    append(summary, "\n".join(header), "w")  # a new summary
    for step, kind, flags in plan:
        if args.only and step not in args.only:
            continue
        left = deadline - time.monotonic()
        need = STEP_SECONDS[args.device][kind]
        if left < need:
            skipped = f"skipped: {max(left, 0):.0f} s of the {args.budget:.0f} s budget left"
            append(summary, f"| {step} | {skipped}, it needs about {need} s |" + " |" * 7)
            continue
        t0 = time.monotonic()
        limit = min(left, 2 * need) if cuda else left  # a loaded CPU is slow, not hung
        if kind == "self-test":
            cells, out = self_test(limit)
        else:
            run = [*shared, *flags]
            try:
                what = describe(*planned(run, 1)[:2])
            except train.ConfigError:  # e.g. float8 without torchao: its row says why; go on
                what = " ".join(flags)
            cells, out = matrix_row(run, shape["steps"], shape["warmup"], 1, cuda, limit)
            cells = [what, *cells]
        with open(os.path.join(args.out, f"{step}.log"), "w") as f:
            f.write(out)
        cells += [""] * (7 - len(cells))  # the self-test's row has one cell
        append(summary, f"| {step} | {' | '.join(cells)} | {time.monotonic() - t0:.0f} |")
    spent = args.budget - (deadline - time.monotonic())
    append(summary, f"\nDone: {spent:.0f} s of the {args.budget:.0f} s budget.")


# --- where a step's time goes (pretrain/measure.py)

def profile(args, extra):
    """train.py in this process under torch.profiler: where --active steps after --warmup spend their
    time, in DIR/profile.md (measure.report), and their Chrome trace in DIR/trace.json.gz."""
    import torch

    import train
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # train.py takes a GPU it sees
    elif not torch.cuda.is_available():
        fail("--device cuda: no GPU visible (use --device cpu)")
    steps = args.warmup + args.active
    vocabulary = meta_vocabulary(extra, args.device)  # Meta's on a GPU, as the other GPU runs
    run = [*vocabulary, *extra, "--training.steps", str(steps), "--checkpoint.enable", "false",
           "--validation.enable", "false"]
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as dump:
        cfg = train.load_config([*run, "--job.dump_folder", dump])
        trace = os.path.join(args.out, "trace.json.gz")
        events, ops = measure.profile_steps(lambda: train.main(cfg), args.warmup, args.active, cuda, trace)
    lines = [f"# bench.py profile: steps {args.warmup + 1}-{steps}", "",
             f"Command: `python bench.py {' '.join(sys.argv[1:])}`, torch {torch.__version__}.", "",
             *measure.report(events, ops, args.active, args.top)]
    with open(os.path.join(args.out, "profile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# --- side by side with torchtitan 0.3.0 or 0.2.2 (pretrain/titan_run.py; the trainer never imports it)

def titan(args, extra):
    version = titan_run.titan_version(args.python)
    if not version:
        fail(f"{args.python} has no torchtitan: pip install --no-deps -r requirements-bench.txt (bench only)")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no GPU visible (use --device cpu)")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # both trainers take a GPU when they see one
    extra = [*meta_vocabulary(extra, args.device), *extra]
    cfg, model, sizes = planned(extra, args.nproc)
    tokens = sizes["global_batch_size"] * cfg.training.seq_len
    print(f"{cfg.model.flavor} {model.args.n_layers} layers, seq {cfg.training.seq_len}, "
          f"{tokens:,} tokens per step, {args.nproc} processes on {args.device}; torchtitan {version}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        titan_run.titan_tokenizer(cfg, folder)
        cmd = titan_run.titan_command(cfg, model.args, sizes, args, folder)

        def theirs():
            out = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT).stdout
            failed = f"error: torchtitan failed:\n{out[-3000:]}"
            return titan_run.steady_tps(out, args.warmup) or sys.exit(failed)
        runs = {"ours": lambda: trainer_tps(extra, args, args.nproc), "torchtitan": theirs}
        measure.side_by_side(runs, args.repeats)


def main(argv: list):
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n")[0],
                                epilog="python bench.py WHAT --help lists its options")
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    for what, doc in [("overhead", "trainer tokens/s vs a bare forward/backward/AdamW loop on the same model"),
                      ("startup", "seconds from launch to the first step, beyond `import torch`"),
                      ("memory", "the memory estimate per device for any flavor and layout; does it fit a GPU"),
                      ("matrix", "one trainer run per combination of --vary values: a markdown table of its log"),
                      ("titan", "this trainer and torchtitan in turn, same shapes: the ratio of tokens/s"),
                      ("mask", "the trainer with block_causal and causal attention in turn: the ratio of tokens/s"),
                      ("loader", "the data loader alone, one stream: realised token shares and tokens/s"),
                      ("gpu", "one command for a GPU node: the GPU self-test, then tokens/s, MFU and memory "
                              "of 1B and 8B-wide runs (bf16, float8, block_causal) into DIR/summary.md"),
                      ("profile", "torch.profiler over a few steps: top kernels, idle gaps, a trace in DIR")]:
        reads = ("It reads train.py's --model.tokenizer_path, --training.seq_len, --training.local_batch_size, "
                 "--data.num_workers and --data.seed; other" if what == "loader" else "Other")
        job = sub.add_parser(what, help=doc, description=doc, epilog=f"{reads} --section.key value arguments set "
                             "train.py's config (python train.py --help lists them).")
        job.add_argument("--config", action="append",
                         help="train.py's TOML config (e.g. configs/debug_model.toml)")
        if what in ("overhead", "matrix", "titan", "mask"):
            job.add_argument("--steps", type=int, default=30 if what == "titan" else 60, help="steps per run")
            job.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run "
                             "(--steps must be a multiple of it)")
        if what in ("overhead", "startup", "titan", "mask"):
            job.add_argument("--repeats", type=int, default=3,
                             help="runs of each kind, alternated; medians reported")
        if what in ("matrix", "titan", "mask"):
            job.add_argument("--nproc", type=int, default=2 if what == "titan" else 1,
                             help="processes per run (torchrun --standalone --nproc_per_node)")
    jobs = sub.choices
    jobs["memory"].add_argument("--world_size", type=int, help="GPUs in the job (needed for all but debugmodel)")
    jobs["memory"].add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                                help="estimate for this device (cpu adds the process's resident memory)")
    jobs["matrix"].add_argument("--vary", action="append", default=[], metavar="SECTION.KEY=A,B",
                                help="a config key and its values; several --vary give every combination")
    jobs["loader"].add_argument("--tokens", type=int, default=1_000_000, help="tokens to read for the timing")
    jobs["loader"].add_argument("--show", type=int, default=0, help="decode this many packed samples instead")
    jobs["titan"].add_argument("--device", choices=["cuda", "cpu"],
                               help="where both run (default: cuda if visible)")
    jobs["titan"].add_argument("--python", default=sys.executable, help="the Python whose torchtitan runs "
                               "(0.3.0 or 0.2.2; default: this one), e.g. a venv's bin/python with 0.2.2")
    jobs["gpu"].add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                             help="cpu: the same steps at tiny shapes (the debug model), end to end in "
                                  "a minute or two")
    jobs["gpu"].add_argument("--budget", type=float, default=540, help="seconds for everything: a step that no "
                             "longer fits is skipped (540: a 10-minute command limit with a minute to spare)")
    jobs["gpu"].add_argument("--out", default="outputs/bench_gpu", metavar="DIR",
                             help="where summary.md (a row per step, written as it ends) and each step's log go")
    jobs["gpu"].add_argument("--only", type=lambda v: v.split(","), metavar="STEP,...",
                             help="run only these steps: self-test, 1B, 8B-wide, 8B-wide-float8-rowwise, "
                                  "8B-wide-float8-tensorwise, 8B-wide-block-causal, 8B-wide-muon, "
                                  "8B-full-ac")
    jobs["profile"].add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where it runs")
    jobs["profile"].add_argument("--warmup", type=int, default=10, help="steps before the profiled ones")
    jobs["profile"].add_argument("--active", type=int, default=3, help="steps profiled")
    jobs["profile"].add_argument("--top", type=int, default=25, help="rows in the table of kernels (ops)")
    jobs["profile"].add_argument("--out", default="outputs/bench_profile", metavar="DIR",
                                 help="where profile.md and trace.json.gz go")
    a, rest = p.parse_known_args(argv)
    configs = [arg for path in a.config or [] for arg in ("--config", path)]
    rest = configs + rest  # train.py refuses two
    for name in ("warmup", "repeats", "world_size", "nproc", "active"):
        if getattr(a, name, None) is not None and getattr(a, name) < 1:
            fail(f"--{name} {getattr(a, name)}: must be >= 1")
    if "steps" in a and (a.steps <= a.warmup or a.steps % a.warmup):
        fail("--steps must be a multiple of --warmup and larger than it")
    vary = getattr(a, "vary", [])
    bad = [v for v in vary if not re.fullmatch(r"\w+\.\w+=[^,]+(,[^,]+)*", v)]
    if bad or (a.what == "matrix" and not vary):
        fail(f"--vary {bad[0] if bad else '(none given)'}: expected section.key=value1,value2")
    # bench.py sets these itself on every trainer run; a user's value would be silently overridden
    ours = {"training.steps", "metrics.log_freq", "job.dump_folder", "checkpoint.enable"}
    keys = [v.partition("=")[0] for v in vary] + [x[2:].partition("=")[0] for x in rest]
    taken = [k for k in keys if k in ours]
    if taken:
        fail(f"{taken[0]} is set by bench.py (use --steps and --warmup); leave it out")
    import train
    try:
        commands = {"overhead": overhead, "startup": startup, "memory": estimate, "matrix": matrix,
                    "titan": titan, "loader": loader, "mask": mask, "gpu": gpu, "profile": profile}
        commands[a.what](a, rest)
    except (train.ConfigError, train.DataError) as e:  # a bad key, value or data source: one line
        fail(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
