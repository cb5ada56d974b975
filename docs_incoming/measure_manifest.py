"""Hub requests and time to the first step at start-up, on the 8B config's hub sources (tests/hub_fixture.py's
local Hub), for one checkout of the trainer: python measure_manifest.py CODE_DIR [LAYOUT ...]

LAYOUT: 1x0 (one process), 2x0 (2 ranks, no loader workers), 2x2 (2 ranks x 2 workers). Each runs the debug
model for 1 step with Meta's Llama 3 tokenizer, the 8B config's six [[data.sources]] and its validation source,
from a fresh HF cache and dump folder (a first start), then again in the same dump folder with 2 steps (a resume
from step 1's checkpoint). Requests are counted by the Hub fixture: api (repo info, tree listings), meta (README
and other non-data files by /resolve/), data (data-file reads)."""
import os, subprocess, sys, tempfile, time, tomllib  # noqa: E401

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "tests"))
from hub_fixture import Hub, make_repos  # noqa: E402
import llama_models  # noqa: E402

code, layouts = os.path.abspath(sys.argv[1]), sys.argv[2:] or ["1x0", "2x0", "2x2"]
TOK = os.path.join(os.path.dirname(llama_models.__file__), "llama3", "tokenizer.model")
hub = Hub(make_repos())
shipped = open(os.path.join(HERE, "configs", "llama3_8b.toml")).read()
sources = shipped[shipped.index("[[data.sources]]"):]
debug = open(os.path.join(code, "configs", "debug_model.toml")).read()
config = debug[:debug.index("[[data.sources]]")].replace("[data]\n", "[data]\nnum_workers = 0\n") + sources
config = config.replace('tokenizer_path = "assets/tokenizer/tokenizer.model"', f'tokenizer_path = "{TOK}"')
tomllib.loads(config)


def count(log):
    kinds = {"api": 0, "meta": 0, "data": 0}
    for r in log:
        p = r["path"].split("?")[0]
        if p.startswith("/api/datasets"):
            kinds["api"] += 1
        elif "/resolve/" in p:
            kinds["data" if p.endswith((".parquet", ".json.gz")) else "meta"] += 1
    return kinds


def start(tmp, ranks, workers, steps):
    cfg = os.path.join(tmp, "hub.toml")
    open(cfg, "w").write(config)
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={ranks}"]
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": os.path.join(tmp, "hf"), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    cmd = launch + ["train.py", "--config", cfg, "--job.dump_folder", os.path.join(tmp, "dump"), "--training.steps",
                    str(steps), "--training.seq_len", "128", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
                    "--checkpoint.enable", "--checkpoint.interval", "1", "--validation.freq", "100",
                    "--validation.steps", "1", "--validation.local_batch_size", "4", "--data.num_streams", "2",
                    "--data.num_workers", str(workers)]
    n, t0 = len(hub.log), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, out = None, []
    for line in proc.stdout:
        out.append(line)
        if first is None and line.startswith("step: "):
            first = time.perf_counter() - t0
    assert proc.wait() == 0, "".join(out[-30:])
    return count(hub.log[n:]), first


for layout in layouts:
    ranks, workers = map(int, layout.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        fresh, t_fresh = start(tmp, ranks, workers, 1)
        resume, t_resume = start(tmp, ranks, workers, 2)
    print(f"{os.path.basename(code)} {layout}: first start {fresh} first step at {t_fresh:.1f}s | "
          f"resume {resume} first step at {t_resume:.1f}s", flush=True)
