"""preflight.py check on 2 CPU processes (gloo): a healthy job is all OK; a job whose dump folder holds a corrupt
data manifest and whose second "node" is 20x slower, lacks a data mirror, cannot reach the Hub, has an unwritable
dump folder and another tokenizer gets a FAIL naming each, and exit 1; what its [data] mirror holds it reads there
(a Hub source, eval tasks read as evals.load reads them), as the run would.

The faulty job's two ranks are started by hand (as torchrun would start them, through the same environment
variables), each in its own working folder standing in for a node's local disk: the config is the same, its
relative paths (tokenizer, data, dump folder) find different files, as on nodes that do not share a filesystem.
Slurm's node name (SLURMD_NODENAME) tells preflight they are two nodes; node-a reaches a local Hub
(tests/hub_fixture.py), node-b's HF_ENDPOINT is a closed port. Under Slurm: tests/test_slurm.py.
"""

import glob
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from hub_fixture import Hub, make_repos, task_repos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "debug_model.toml")
CPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path on any machine
CHECKS = ["software", "matmul", "bandwidth within nodes", "bandwidth across nodes", "data manifest",
          "data source 'c4'", "validation source 'finemath'", "dump folder", "free space", "tokenizer"]


def verdicts(out: str) -> dict:
    """{check: (level, text)} from preflight's verdict lines."""
    return {m[1]: (m[0], m[2]) for m in re.findall(r"^(OK|WARN|FAIL) +([^:]+): (.*)$", out, re.M)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """The debug config on 2 processes; its dump folder holds the data manifest a run made, with the training
    sources (each local folder's entry as data_manifest.resolve_source makes it); the validation sources are not pinned."""
    sys.path.insert(0, ROOT)
    from pretrain import data_manifest
    import train
    dump, entries = tmp_path_factory.mktemp("dump"), []
    for s in train.load_config(["--config", CONFIG]).data.sources:
        files = [(os.path.relpath(f, os.path.join(ROOT, s.path)), os.path.getsize(f), f)
                 for f in sorted(glob.glob(os.path.join(ROOT, s.path, s.data_files)))]
        entries.append({**{k: getattr(s, k) for k in data_manifest.KEY}, "commit": None,
                        "files": [[rel, size, data_manifest.ends_sha256(f, size)] for rel, size, f in files]})
    (dump / "data_manifest.json").write_text(json.dumps({"version": 1, "data": entries, "validation": []}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "preflight.py",
           "check", "--config", CONFIG, "--job.dump_folder", str(dump)]
    proc = subprocess.run(cmd, cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    return proc, dump


@pytest.mark.slow
def test_healthy_job_prints_the_table_and_every_check_ok(healthy):
    proc, dump = healthy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^ +([01])  (\S+) +CPU .* (\d+\.\d+)  ([0-9a-f]{10}) shared ", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[2]) > 0 for r in rows), proc.stdout
    got = verdicts(proc.stdout)
    assert {k: v[0] for k, v in got.items()} == {k: "OK" for k in got}, proc.stdout
    for check in CHECKS:
        assert any(k.startswith(check) for k in got), (check, proc.stdout)
    assert len([k for k in got if "source" in k]) == 8  # 4 training + 4 validation sources of the debug config
    assert got["bandwidth across nodes"][1] == "n/a (one node)"
    intra = re.search(r"all-reduce ([\d.]+) ([\d.]+) GB/s; all-gather ([\d.]+) ([\d.]+) GB/s", proc.stdout)
    assert intra and all(float(x) > 0 for x in intra.groups()), proc.stdout
    assert got["data manifest"][1].startswith(f"4 source(s) pinned in {dump}/data_manifest.json; rank 0 resolved 4 "
                                              "source(s) once"), proc.stdout  # the validation sources
    assert "0 FAIL, 0 WARN of 16 checks" in proc.stdout
    # Each line as its check ends: what each rank saw alone, then the data (rank 0 resolves, every node reads),
    # then the bandwidth (collectives), not all at the end in the order of a table.
    order = [k.split(" ")[0] for k in verdicts(proc.stdout)]
    assert order[:5] == ["software", "matmul", "dump", "free", "tokenizer"] and order[-2:] == ["bandwidth"] * 2, order
    assert os.listdir(dump) == ["data_manifest.json"]  # its probe files are gone, the manifest is as it was
    assert json.loads((dump / "data_manifest.json").read_text())["validation"] == []


def test_bad_config_is_one_line_exit_2(capsys):
    import preflight  # in this process: `python preflight.py check ...` is main(argv), and torch's imports take 3 s
    with pytest.raises(SystemExit) as e:
        preflight.main(["check", "--config", CONFIG, "--training.sequence_len", "64"])
    stderr = capsys.readouterr().err
    assert e.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: unknown key in [training] 'sequence_len'; did you mean seq_len?"), stderr


HUB_SOURCES = """
[[data.sources]]
name = "c4_hub"
path = "allenai/c4"
config = "en"
weight = 0.1

[[data.sources]]
name = "finemath_hub"
path = "HuggingFaceTB/finemath"
config = "finemath-3plus"
weight = 0.1

[eval]
enable = true
limit = 4
tasks = [{name = "hellaswag"}, {name = "arc_easy"}]
"""


def write_mirror(folder: str, repos: dict, wanted: dict):
    """What download_data.py would fetch into `folder` ([data] mirror): each repo's files at main whose paths start
    with wanted[repo], at DIR/<repo>@<commit>/<path>, each with its record of the download's checks."""
    sys.path.insert(0, ROOT)
    from pretrain import data_manifest
    from pretrain import mirror
    for repo, prefix in wanted.items():
        sha = repos[repo]["refs"]["main"]
        for path, body in repos[repo]["commits"][sha].items():
            if path.startswith(prefix) and path.endswith(".parquet"):
                local, record = mirror.mirror_paths(folder, f"hf://datasets/{repo}@{sha}/{path}")
                os.makedirs(os.path.dirname(local), exist_ok=True)
                with open(local, "wb") as f:
                    f.write(body)
                data_manifest.write_manifest({"commit": sha, "size": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                                        "ends": data_manifest.ends_sha256(local, len(body))}, record)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Rank 0 on "node-a", a healthy copy but for a corrupt data_manifest.json in its dump folder; rank 1 on
    "node-b": 20x slower matmul (the test-only variable), no C4 copy, no Hub, a regular file where the dump
    folder should be, and a different tokenizer.model. The config: the debug one plus two hub sources and two eval
    tasks, and [data] mirror: node-a has none (it reads the Hub), node-b's holds FineMath and the tasks, not C4."""
    tmp = tmp_path_factory.mktemp("nodes")
    with open(CONFIG) as f:
        config = f.read() + HUB_SOURCES
    (tmp / "hub.toml").write_text(config)
    a, b = tmp / "node-a", tmp / "node-b"
    os.makedirs(a)
    os.symlink(os.path.join(ROOT, "assets"), a / "assets")
    os.makedirs(a / "dump")
    (a / "dump" / "data_manifest.json").write_text('{"version": 1, "data": [')  # a run's, cut short
    os.makedirs(b / "assets" / "data")
    for name in ("zyda2", "finemath"):  # C4 is not mirrored on node-b
        os.symlink(os.path.join(ROOT, "assets", "data", name), b / "assets" / "data" / name)
    os.makedirs(b / "assets" / "tokenizer")
    with open(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"), "rb") as f:
        (b / "assets" / "tokenizer" / "tokenizer.model").write_bytes(f.read() + b"\n")  # another version
    (b / "dump").write_text("a file, not a folder")
    repos = {**make_repos(), **task_repos()}
    write_mirror(str(b / "mirror"), repos, {"HuggingFaceTB/finemath": "finemath-3plus/", "Rowan/hellaswag": "",
                                            "allenai/ai2_arc": "ARC-Easy/"})
    env = {k: v for k, v in CPU.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", PREFLIGHT_TEST_SLOW_RANK="1", OMP_NUM_THREADS="1")
    hub = Hub(repos)
    try:
        procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "preflight.py"), "check", "--config",
                                   str(tmp / "hub.toml"), "--job.dump_folder", "dump", "--data.mirror", "mirror"],
                                  cwd=cwd, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**env, "RANK": str(rank), "SLURMD_NODENAME": cwd.name, "HF_HOME": str(cwd / "hf"),
                                       "HF_ENDPOINT": hub.endpoint if rank == 0 else f"http://127.0.0.1:{free_port()}"})
                 for rank, cwd in enumerate((a, b))]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        hub.close()
    return [p.returncode for p in procs], outs, (a / "dump" / "data_manifest.json").read_text()


@pytest.mark.slow
def test_faults_are_named_and_exit_1(faulty):
    codes, (out, other), manifest = faulty
    assert codes == [1, 1], out[-3000:] + other[-3000:]
    assert other == ""  # only rank 0 reports
    got = verdicts(out)
    level, text = got["matmul"]  # 20x slower: 5% of the other rank
    assert level == "FAIL" and "slowest rank 1 on node-b" in text and "; FAIL: ranks [1] (" in text, out
    level, text = got["data manifest"]  # one line, the dump folder's own fix; left as it was; sources checked anyway
    assert level == "FAIL" and text.startswith("data manifest dump/data_manifest.json cannot be used: "), out
    assert "delete it" in text and "data.py" not in text and manifest == '{"version": 1, "data": [', out
    for kind, split in (("data", "train"), ("validation", "validation")):  # node-b checks rank 0's file list
        level, text = got[f"{kind} source 'c4' (assets/data/c4)"]
        assert level == "FAIL" and text.startswith(f"unreadable on node(s) node-b: data source 'c4': assets/data/c4/"
                                                   f"en/c4-{split}.00000-of-"), out
        assert "is missing on this node, unlike on rank 0's: every node needs the same files" in text, out
    assert got["data source 'finemath' (assets/data/finemath)"][0] == "OK"
    level, text = got["data source 'c4_hub' (allenai/c4)"]  # node-a read it from the Hub, node-b cannot reach it
    assert level == "FAIL" and text.startswith("unreadable on node(s) node-b: this node cannot reach the Hub at "
                                               "http://127.0.0.1:"), out
    assert re.search(r", and \S+/node-b/mirror/allenai/c4@[0-9a-f]{40}/en/c4-train\.\d+-of-00004\.json\.gz is not in "
                     "the data mirror$", text), text
    # What node-b's mirror holds it reads there, as the run would (issue 43, item 7); the eval tasks are read as
    # evals.load reads them, not as text sources with no column '' (item 10): node-a from the Hub, node-b its mirror
    for name in ("data source 'finemath_hub' (HuggingFaceTB/finemath)", "eval task 'hellaswag' (Rowan/hellaswag)",
                 "eval task 'arc_easy' (allenai/ai2_arc)"):
        level, text = got[name]
        assert level == "OK" and text.endswith(" on every node (2), from the data mirror mirror where it holds the "
                                               "file"), (name, out)
    assert got["eval task 'arc_easy' (allenai/ai2_arc)"][1].startswith("its first example reads in the task's layout")
    level, text = got["dump folder dump"]
    assert level == "FAIL" and "rank 1 on node-b" in text and "not writable (FileExistsError" in text, out
    level, text = got["tokenizer assets/tokenizer/tokenizer.model"]
    assert level == "FAIL" and "ranks [0] (node node-a)" in text and "ranks [1] (node node-b)" in text, out
    # two "nodes" with one rank each: the across-nodes bandwidth is measured, within-node is n/a
    assert got["bandwidth within nodes"] == ("OK", "n/a (one rank per node)")
    assert got["bandwidth across nodes"][0] == "OK" and "2 nodes: busbw" in got["bandwidth across nodes"][1]
    assert got["software"][0] == got["free space"][0] == "OK"
    assert "7 FAIL, 0 WARN of 20 checks" in out


def report(cfg, ranks, nodes, inter, sizes, ckpt) -> int:
    """preflight.check's report on what its ranks gathered, on GPUs."""
    import preflight
    verdict = preflight.Verdicts()
    preflight.report_ranks(cfg, ranks, ckpt, True, verdict)
    listed = preflight.data_check.configured(cfg.data.sources, cfg.validation.sources, cfg.eval)
    preflight.report_data(cfg, listed, ranks, nodes, verdict)
    preflight.report_bandwidth(ranks, nodes, inter, sizes, True, verdict)
    return verdict.summary(1.0)


def test_gpu_thresholds_on_a_made_up_cluster(capsys):
    """preflight's report with what 2 nodes x 4 H100s would gather: the GPU thresholds, without GPUs. A slow GPU and
    one 20x slower, PCIe-class bandwidth within a node, one rail's bandwidth across nodes (then TCP's), and free
    space for fewer checkpoints than the run keeps."""
    sys.path.insert(0, ROOT)
    import train
    cfg = train.load_config(["--config", CONFIG, "--job.dump_folder", "/shared/run", "--checkpoint.enable", "true"])
    sha, sizes, gib = "ab" * 32, [2**20, 2**24, 2**28, 2**30], 2**30

    def rank(node, tflops, intra, free):
        return {"node": node, "device": "NVIDIA H100 80GB HBM3", "versions": ("2.13.0+cu130", "CUDA 13.0", "2.28.3"),
                "hidden_gpus": False, "tflops": tflops, "dump": "", "free": free, "tokenizer": sha, "shared": True,
                "intra": {"all-reduce": [10, 80, 200, intra], "all-gather": [8, 60, 150, intra]}, "data": {},
                "manifest": ("OK", "none pinned yet")}
    nodes = {"gpu-a": [0, 1, 2, 3], "gpu-b": [4, 5, 6, 7]}
    tf = [720.0, 700.0, 35.0, 705.0, 510.0, 715.0, 710.0, 700.0]
    ranks = [rank("gpu-a" if i < 4 else "gpu-b", t, 300.0 if i < 4 else 40.0, 1.5 * gib) for i, t in enumerate(tf)]
    one_rail = {"all-reduce": [1, 8, 40, 45.0], "all-gather": [1, 8, 35, 42.0]}  # 1 x 400 Gbit/s of 4
    code = report(cfg, ranks, nodes, one_rail, sizes, gib)
    got = verdicts(capsys.readouterr().out)
    assert code == 1
    level, text = got["matmul"]  # 35: 5% of the median of the others (705) FAILs; 510 (72%) WARNs
    assert level == "FAIL" and "slowest rank 2 on gpu-a: 35.000 = 5% of the others' median; FAIL: ranks [2]; WARN: " \
        "ranks [4] (" in text and "median 702.500 TFLOP/s" in text and "71% of" in text, text
    level, text = got["bandwidth within nodes"]
    assert level == "WARN" and text.startswith("slowest node gpu-b: busbw at 1 MiB/16 MiB/256 MiB/1024 MiB")
    level, text = got["bandwidth across nodes"]  # 45 GB/s is one link's rate, but 4 GPUs share the node: WARN < 80
    assert level == "WARN" and "all-reduce 1.00 8.00 40.00 45.00 GB/s" in text and "per GPU x 4 GPUs per node" in text
    level, text = got["free space"]  # debug config: 50 steps, a checkpoint every 25, all kept: 2 GiB
    assert level == "FAIL" and text.startswith("1.5 GiB for 2 more checkpoint(s) of 1.00 GiB (keep_latest_k = 0 "), text
    assert got["software"][0] == got["dump folder /shared/run"][0] == got["data manifest"][0] == "OK"

    cfg.checkpoint.keep_latest_k, cfg.checkpoint.interval = 1, 5  # 10 saves, 1 kept + 1 being written: 2 GiB
    for r in ranks:
        r["tflops"], r["free"] = 700.0, 2.5 * gib
    tcp = {"all-reduce": [0.5, 2, 6, 9.0], "all-gather": [0.5, 2, 5, 8.0]}
    code = report(cfg, ranks, nodes, tcp, sizes, gib)
    got = verdicts(capsys.readouterr().out)
    assert code == 1 and got["matmul"][0] == "OK"
    level, text = got["bandwidth across nodes"]
    assert level == "FAIL" and "TCP sockets" in text
    level, text = got["free space"]  # 2 needed, 3 (one more) advised
    assert level == "WARN" and text.startswith("2.5 GiB for 2 more checkpoint(s) of 1.00 GiB (keep_latest_k = 1: "), text


def test_per_node_groups_wait_comm_init_timeout_seconds():
    """preflight's per-node groups (the bandwidth within a node) give up on a frozen rank after
    comm.init_timeout_seconds, as the trainer's groups do, not after the backend's default (gloo 30 min, NCCL 10).
    One gloo process, in this process."""
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    import preflight
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=77))
    try:
        groups = preflight.node_groups({"node-a": [0]}, 77)
        assert groups["node-a"]._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=77)
    finally:
        dist.destroy_process_group()
