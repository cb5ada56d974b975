"""preflight.py check's measurements of each node's devices and links: a device's matmul speed, and
the bus bandwidth of a process group as nccl-tests counts it (within a node, and across nodes)."""

import os
import time

# FOR TESTS ONLY: that rank sleeps inside preflight.py's matmul timing (20x slower)
SLOW_RANK = "PREFLIGHT_TEST_SLOW_RANK"


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
