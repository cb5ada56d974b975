"""preflight.py check on 2 CPU processes (gloo): a healthy job is all OK; a job whose second "node" is slow, lacks
a data mirror, cannot reach the Hub, has an unwritable dump folder and another tokenizer gets a WARN or FAIL
naming each, and exit 1.

The faulty job's two ranks are started by hand (as torchrun would start them, through the same environment
variables), each in its own working folder standing in for a node's local disk: the config is the same, its
relative paths (tokenizer, data, dump folder) find different files, as on nodes that do not share a filesystem.
Slurm's node name (SLURMD_NODENAME) tells preflight they are two nodes; node-a reaches a local Hub
(tests/hub_fixture.py), node-b's HF_ENDPOINT is a closed port. Under Slurm: tests/test_slurm.py.
"""

import os
import re
import socket
import subprocess
import sys

import pytest
from hub_fixture import Hub, make_repos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "debug_model.toml")
CPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path on any machine
CHECKS = ["software", "matmul", "bandwidth within nodes", "bandwidth across nodes", "data source 'c4'",
          "validation source 'finemath'", "dump folder", "free space", "tokenizer"]


def verdicts(out: str) -> dict:
    """{check: (level, text)} from preflight's verdict lines."""
    return {m[1]: (m[0], m[2]) for m in re.findall(r"^(OK|WARN|FAIL) +([^:]+): (.*)$", out, re.M)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    dump = tmp_path_factory.mktemp("dump")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "preflight.py",
           "check", "--config", CONFIG, "--job.dump_folder", str(dump)]
    proc = subprocess.run(cmd, cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    return proc, dump


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
    assert "0 FAIL, 0 WARN of 15 checks" in proc.stdout
    assert os.listdir(dump) == []  # its probe files are gone


def test_bad_config_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "preflight.py", "check", "--config", CONFIG, "--training.sequence_len", "64"],
                          cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: unknown key in [training] 'sequence_len'; did you mean seq_len?"), proc.stderr


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Rank 0 on "node-a", a healthy copy; rank 1 on "node-b": slow matmul (the test-only variable), no C4
    mirror, no Hub, a regular file where the dump folder should be, and a different tokenizer.model. The
    config: the debug one plus a hub source."""
    tmp = tmp_path_factory.mktemp("nodes")
    with open(CONFIG) as f:
        config = f.read() + '\n[[data.sources]]\nname = "c4_hub"\npath = "allenai/c4"\nconfig = "en"\nweight = 0.1\n'
    (tmp / "hub.toml").write_text(config)
    a, b = tmp / "node-a", tmp / "node-b"
    os.makedirs(a)
    os.symlink(os.path.join(ROOT, "assets"), a / "assets")
    os.makedirs(b / "assets" / "data")
    for name in ("zyda2", "finemath"):  # C4 is not mirrored on node-b
        os.symlink(os.path.join(ROOT, "assets", "data", name), b / "assets" / "data" / name)
    os.makedirs(b / "assets" / "tokenizer")
    with open(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"), "rb") as f:
        (b / "assets" / "tokenizer" / "tokenizer.model").write_bytes(f.read() + b"\n")  # another version
    (b / "dump").write_text("a file, not a folder")
    env = {k: v for k, v in CPU.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", PREFLIGHT_TEST_SLOW_RANK="1", OMP_NUM_THREADS="1")
    hub = Hub(make_repos())
    try:
        procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "preflight.py"), "check", "--config",
                                   str(tmp / "hub.toml"), "--job.dump_folder", "dump"], cwd=cwd, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**env, "RANK": str(rank), "SLURMD_NODENAME": cwd.name, "HF_HOME": str(cwd / "hf"),
                                       "HF_ENDPOINT": hub.endpoint if rank == 0 else f"http://127.0.0.1:{free_port()}"})
                 for rank, cwd in enumerate((a, b))]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        hub.close()
    return [p.returncode for p in procs], outs


def test_faults_are_named_and_exit_1(faulty):
    codes, (out, other) = faulty
    assert codes == [1, 1], out[-3000:] + other[-3000:]
    assert other == ""  # only rank 0 reports
    got = verdicts(out)
    level, text = got["matmul"]
    assert level == "WARN" and "slowest rank 1 on node-b" in text and "too slow: ranks [1]" in text, out
    for kind in ("data", "validation"):
        level, text = got[f"{kind} source 'c4' (assets/data/c4)"]
        assert level == "FAIL" and text.startswith("unreadable on node(s) node-b: data source 'c4'"), out
    assert got["data source 'finemath' (assets/data/finemath)"][0] == "OK"
    level, text = got["data source 'c4_hub' (allenai/c4)"]  # node-a read it from the Hub, node-b cannot reach it
    assert level == "FAIL" and text.startswith("unreadable on node(s) node-b: this node cannot reach the Hub at "
                                               "http://127.0.0.1:"), out
    level, text = got["dump folder dump"]
    assert level == "FAIL" and "rank 1 on node-b" in text and "not writable (FileExistsError" in text, out
    level, text = got["tokenizer assets/tokenizer/tokenizer.model"]
    assert level == "FAIL" and "ranks [0] (node node-a)" in text and "ranks [1] (node node-b)" in text, out
    # two "nodes" with one rank each: the across-nodes bandwidth is measured, within-node is n/a
    assert got["bandwidth within nodes"] == ("OK", "n/a (one rank per node)")
    assert got["bandwidth across nodes"][0] == "OK" and "2 nodes: busbw" in got["bandwidth across nodes"][1]
    assert got["software"][0] == got["free space"][0] == "OK"
    assert "5 FAIL, 1 WARN of 16 checks" in out


def test_gpu_thresholds_on_a_made_up_cluster(capsys):
    """preflight.report with what 2 nodes x 2 H100s would gather: the GPU thresholds, without GPUs. A slow
    GPU, PCIe-class bandwidth within a node and TCP-class bandwidth across nodes."""
    sys.path.insert(0, ROOT)
    import preflight
    import train
    cfg = train.load_config(["--config", CONFIG, "--job.dump_folder", "/shared/run"])
    sha, sizes = "ab" * 32, [2**20, 2**24, 2**28, 2**30]

    def rank(node, tflops, intra):
        return {"node": node, "device": "NVIDIA H100 80GB HBM3", "versions": ("2.13.0+cu130", "CUDA 13.0", "2.28.3"),
                "hidden_gpus": False, "tflops": tflops, "dump": "", "free": 2**40, "tokenizer": sha, "shared": True,
                "intra": {"all-reduce": [10, 80, 200, intra], "all-gather": [8, 60, 150, intra]}, "data": {}}
    ranks = [rank("gpu-a", 720.0, 300.0), rank("gpu-a", 700.0, 300.0), rank("gpu-b", 510.0, 40.0), rank("gpu-b", 715.0, 40.0)]
    inter = {"all-reduce": [1, 3, 9, 11.0], "all-gather": [1, 3, 8, 10.0]}
    code = preflight.report(cfg, ranks, {"gpu-a": [0, 1], "gpu-b": [2, 3]}, inter, sizes, 2**30, True, 1.0)
    got = verdicts(capsys.readouterr().out)
    assert code == 1
    level, text = got["matmul"]  # 510 < 80% of the median 707.5; 72% of the H100's 989
    assert level == "WARN" and "slowest rank 2 on gpu-b: 510.000; too slow: ranks [2]" in text and "72% of" in text
    level, text = got["bandwidth within nodes"]
    assert level == "WARN" and text.startswith("slowest node gpu-b: busbw at 1 MiB/16 MiB/256 MiB/1024 MiB")
    level, text = got["bandwidth across nodes"]
    assert level == "FAIL" and "all-reduce 1.00 3.00 9.00 11.00 GB/s" in text and "TCP sockets" in text
    assert got["software"][0] == got["dump folder /shared/run"][0] == got["free space"][0] == "OK"
