"""How bench.py measures, apart from what it measures: a command within a time limit, two runs in
turn with medians and the load beside them, the steady-state rate of a training log, and where a
step's time goes (torch.profiler over chosen steps of any loop that steps a torch optimizer, its
Chrome trace, and a report of that trace: the loop's host sync; on a GPU the kernels that take the
time, how busy the device was, its longest idle gaps and the caching allocator's retries; on a CPU
the ops). preflight.py's measurements of a node are pretrain/device_check.py's.
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
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root


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


def idle_at(kernels: list, t: float) -> float:
    """How long the device sat idle around time t: from the last kernel to end before t to the first
    to start after it; 0 where a kernel ran at t or none is on one side."""
    before = [stop for _, stop, _ in kernels if stop < t]
    after = [start for start, _, _ in kernels if start > t]
    if any(start <= t <= stop for start, stop, _ in kernels) or not before or not after:
        return 0
    return min(after) - max(before)


# The loop's one host sync, a range of its own in a trace (pretrain/agreement.py)
AGREEMENT = "StepAgreement.on_step"


def agreement_cost(events: list, kernels: list, active: int) -> str:
    """A line on the loop's host sync: its time on the host a step and, on a GPU, the device's idle
    time around its end (the sync drained the device's queue; the device waits there for the host to
    launch optimizer.step()), each also as a share of a step."""
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] == AGREEMENT]
    steps = [e["dur"] for e in events
             if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    if not ranges or not steps:
        return f"No `{AGREEMENT}` range in the profiled steps."
    step = sum(steps) / len(steps)
    host = sum(stop - start for start, stop in ranges) / active
    line = f"The loop's host sync (`{AGREEMENT}`): {host / 1e3:.2f} ms a step on the host ({100 * host / step:.1f}%)"
    if not kernels:
        return line + "."
    idle = sum(idle_at(kernels, stop) for _, stop in ranges) / active
    return line + f"; the device idle around its end {idle / 1e3:.2f} ms a step ({100 * idle / step:.2f}%)."


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
        first = []  # the optimizer whose steps count: Muon's inner AdamW steps inside MuonAdamW's step

        def step(optimizer, *_):
            if not first:
                first.append(optimizer)
            if optimizer is first[0]:
                prof.step()
        hook = register_optimizer_step_post_hook(step)
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
    """Markdown lines: the loop's host sync; on a GPU the device's busy share, its longest idle gaps,
    the allocator's retries and the `top` kernels by time; on a CPU (no kernels) the `top` ops by
    their own time."""
    # The device's rows as Perfetto draws them: kernels, copies, memsets. Not the annotations the
    # profiler mirrors onto the GPU's row: they span whole steps.
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return [agreement_cost(events, kernels, active), "", ops.table(sort_by="self_cpu_time_total", row_limit=top)]
    busy, span, gaps = device_timeline(kernels)
    lines = [agreement_cost(events, kernels, active), "",
             f"Device busy {100 * busy / span:.1f}% of {span / 1e3:,.1f} ms "
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
