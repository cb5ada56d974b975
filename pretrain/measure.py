"""How bench.py and preflight.py measure, apart from what they measure: a command within a time
limit, two runs in turn with medians and the load beside them, the steady-state rate of a training log, and where a
step's time goes (torch.profiler over chosen steps of any loop that steps a torch optimizer, its
Chrome trace, and a report of that trace: on a GPU the kernels that take the time, how busy the
device was, its longest idle gaps and the caching allocator's retries; on a CPU the ops); and, for
preflight.py, a device's matmul speed and the bus bandwidth of a process group, as nccl-tests counts it.
"""

import gzip
import json
import importlib.util
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
# FOR TESTS ONLY: that rank sleeps inside preflight.py's matmul timing (20x slower)
SLOW_RANK = "PREFLIGHT_TEST_SLOW_RANK"


def meta_tokenizer() -> str:
    """Meta's Llama 3 tokenizer.model as llama-models ships it, or "": the vocabulary users train
    (128,256 words), which GPU figures are measured with."""
    spec = importlib.util.find_spec("llama_models")
    path = os.path.join(os.path.dirname(spec.origin), "llama3", "tokenizer.model") if spec else ""
    return path if os.path.isfile(path) else ""


def run_command(cmd: list, timeout: float = None):
    """(exit status, output) of cmd in the repo root; status None if it ran past `timeout` seconds:
    then it is stopped with its process group (compile and loader workers too), so the GPU is free
    for the next command."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=timeout is not None)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stopped = f"\nbench.py: stopped at {timeout:.0f} s, the end of its time\n"
        return None, proc.communicate()[0] + stopped
    except KeyboardInterrupt:  # in its own session it did not see the Ctrl-C
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


def steady_tps(records: list, warmup: int) -> float:
    # Each record after the warmup covers the same number of tokens: the rate is their harmonic mean
    return statistics.harmonic_mean(r["tps"] for r in records if r["step"] > warmup)


def side_by_side(runs: dict, repeats: int, load=os.getloadavg) -> dict:
    """Runs the two sides in turn (A B A B ...), so a change in the machine's load hits both; prints
    each pair, then the median of pair ratios (first side / second), the medians and the load."""
    (a, _), (b, _) = runs.items()
    tps = {a: [], b: []}
    ratios = []
    loads = []
    for i in range(repeats):
        for name, run in runs.items():
            loads.append(load()[0])
            tps[name].append(run())
        loads.append(load()[0])
        ratios.append(tps[a][-1] / tps[b][-1])
        pair = f"{a} {tps[a][-1]:,.0f}, {b} {tps[b][-1]:,.0f} tokens/s per process"
        seen = " ".join(f"{x:.1f}" for x in loads[-3:])
        print(f"pair {i + 1}: {pair}, ratio {ratios[-1]:.3f}, load {seen}", flush=True)
    med = {name: statistics.median(v) for name, v in tps.items()}
    ratio = statistics.median(ratios)
    pairs = ", ".join(f"{r:.3f}" for r in ratios)
    medians = f"medians {med[a]:,.0f} / {med[b]:,.0f} = {med[a] / med[b]:.3f} tokens/s"
    print(f"{a} / {b}: {ratio:.3f} (median of {repeats} pair ratios {pairs}; {medians}); "
          f"1-minute load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    return {"ratio": ratio, "ratios": ratios, "medians": med, "load": (min(loads), max(loads))}


# --- where a step's time goes

def device_timeline(kernels: list) -> tuple:
    """(busy, span, gaps) of the device's kernels, each (start, end, name) in microseconds: the union
    of their intervals, the first start to the last end, and the idle gaps between them as (length,
    kernel before, kernel after), longest first."""
    busy, gaps, end, before = 0, [], None, ""
    for start, stop, name in sorted(kernels):
        if end is not None and start > end:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            busy += stop - (start if end is None else max(start, end))
            end, before = stop, name
    span = end - min(kernels)[0] if kernels else 0
    return busy, span, sorted(gaps, reverse=True)


def profile_steps(run: Callable, warmup: int, active: int, cuda: bool, trace: str) -> tuple:
    """Calls run() with torch.profiler recording steps warmup + 1 .. warmup + active, a step ending
    at each optimizer step (so the loop needs no hook of its own), and writes the Chrome trace,
    gzipped, to `trace` (perfetto.dev opens it). Returns (the trace's events, the ops' averages)."""
    import torch  # here, not at the top: bench.py's other commands start without it
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, schedule
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    when = schedule(wait=warmup - 1, warmup=1, active=active, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=when) as prof:
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            run()
        finally:
            hook.remove()
    with tempfile.TemporaryDirectory() as folder:
        raw = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(trace, "wb") as z:  # a large model's trace is large
            shutil.copyfileobj(f, z)
        with open(raw) as f:
            return json.load(f)["traceEvents"], prof.key_averages()


def report(events: list, ops, active: int, top: int) -> list:
    """Markdown lines: on a GPU the device's busy share, its longest idle gaps, the allocator's
    retries and the `top` kernels by time; on a CPU (no kernels) the `top` ops by their own time."""
    # The device's rows as Perfetto draws them: kernels, copies, memsets. Not the annotations the
    # profiler mirrors onto the GPU's row: they span whole steps.
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return [ops.table(sort_by="self_cpu_time_total", row_limit=top)]
    busy, span, gaps = device_timeline(kernels)
    lines = [f"Device busy {100 * busy / span:.1f}% of {span / 1e3:,.1f} ms "
             f"({span / 1e3 / active:,.1f} ms a step); the longest idle gaps:"]
    lines += [f"- {gap / 1e3:.2f} ms, after `{a[:70]}`, before `{b[:70]}`" for gap, a, b in gaps[:8]]
    # A retry frees the allocator's cache and waits for the device: the idle gaps of a full GPU
    import torch
    stats = torch.cuda.memory_stats()
    lines += ["", f"Allocator: {stats.get('num_alloc_retries', 0)} retries (freed its cache and tried "
              f"again), {stats.get('num_ooms', 0)} OOMs, over the whole run.", "",
              "| kernel | calls | ms a step | % of busy |", "|---|---|---|---|"]
    total = {}
    for start, stop, name in kernels:
        calls, us = total.get(name, (0, 0))
        total[name] = (calls + 1, us + stop - start)
    for name, (calls, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| `{name[:100]}` | {calls} | {us / 1e3 / active:.2f} | {100 * us / busy:.1f}% |")
    return lines


def matmul_tflops(device, rank: int) -> float:
    """A dense matmul's TFLOP/s, the fastest of the runs in half a second (8 at least) after 2
    warm-ups: a busy neighbour only ever slows a run down, so the fastest is the device's own
    speed. bf16 8192^2 on GPU, fp32 512^2 on CPU."""
    import torch
    gpu = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if gpu else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # the operands
    times = []  # seconds of each run
    start = time.perf_counter()
    while len(times) < 10 or time.perf_counter() - start < 0.5:
        t0 = time.perf_counter()
        a @ b
        if gpu:
            torch.cuda.synchronize()
        if os.environ.get(SLOW_RANK) == str(rank):
            time.sleep(19 * (time.perf_counter() - t0))
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times[2:]) / 1e12


def bus_bandwidth(group, device, sizes) -> dict:
    """{op: [GB/s per size]} as nccl-tests computes it from the slowest rank's time: algbw = bytes
    of the result / time; all-reduce busbw = algbw x 2(n-1)/n, all-gather busbw = algbw x
    (n-1)/n."""
    import torch
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the newer name first
    n = dist.get_world_size(group)
    out = {}
    for size in sizes:
        part = torch.ones(size // 4 // n, device=device)
        full = torch.ones(len(part) * n, device=device)  # all-gather's output: n parts
        ops = (("all-reduce", lambda: dist.all_reduce(full, group=group), 2 * (n - 1) / n),
               ("all-gather", lambda: gather(full, part, group=group), (n - 1) / n))
        for op, run, factor in ops:
            run()  # two warm-ups: connections, buffers
            run()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(5):
                run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
            out.setdefault(op, []).append(full.nbytes * 5 / dt.item() * factor / 1e9)
    return out
