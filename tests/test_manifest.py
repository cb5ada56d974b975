"""The data manifest: one resolution per job, pinned in the run (data.py's manifest section, train.py's use of it).

The training runs here train the debug model at conftest.SMALL's shape with the bundled tokenizer: what
they test (which files are resolved, pinned, fetched and read) does not follow the model or its vocabulary,
and Meta's 128,256 tokens made each run's model 66M parameters (0.8 GB a checkpoint). Hub runs talk to
tests/hub_fixture.py's server, which counts requests.
"""

import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
import download_data  # noqa: E402
from pretrain import mirror as mirrors  # noqa: E402  (tests name their mirror folders `mirror`)
from pretrain import data_manifest  # noqa: E402
from pretrain.sources import DataError, DataSource  # noqa: E402
from hub_fixture import Hub, _jsonl_gz, _parquet, make_repos, point_libraries_at, push  # noqa: E402
from conftest import SMALL, run_training  # noqa: E402

SHIPPED = tomllib.load(open(os.path.join(ROOT, "configs", "llama3_8b.toml"), "rb"))
TOKENIZER = os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")
TRAIN = [*SMALL, "--training.local_batch_size", "4", "--metrics.log_freq", "1",
         "--model.tokenizer_path", TOKENIZER, "--checkpoint.enable", "--checkpoint.interval", "2"]


def train(config, dump, *args, nproc=1, env=None, expect=0):
    proc = run_training(["--config", config, "--job.dump_folder", dump, *TRAIN, *args], nproc,
                        env={"OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(dump) -> list:
    return [(r["step"], r["loss"]) for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r]


def api_requests(log) -> list:
    """Requests that list or look up (repo info, tree pages, README and other metadata): all but data-file reads."""
    return [r["path"] for r in log if not r["path"].split("?")[0].endswith((".parquet", ".json.gz"))]


@pytest.fixture(scope="module")
def hub_job(tmp_path_factory):
    """The 8B config's six hub sources and its C4 validation split, 2 ranks x 2 loader workers: 4 steps with
    checkpoints at 2 and 4; then a new commit on every repo (a C4 shard that sorts first, changed C4 and
    FineMath shards); then a resume from step 2. Returns what the test checks."""
    tmp = tmp_path_factory.mktemp("hub_job")
    repos, mp = make_repos(), pytest.MonkeyPatch()
    hub = Hub(repos)
    point_libraries_at(hub.endpoint, mp, str(tmp / "cache"))
    try:
        # One resolution in a fresh process (this one has caches of earlier tests: the Hub client's one-time
        # lookups, dataset cards), with its own empty HF_HOME, as a rank starts. The config's tables are read
        # with tomllib, not train.load_config: importing train (torch) would add 4 s of CPU.
        code = ("import json, sys, tomllib; from pretrain import data_manifest; from pretrain.sources import DataSource; "
                "c = tomllib.load(open(sys.argv[1], 'rb')); "
                "print(json.dumps(data_manifest.make_manifest(*([DataSource(**t) for t in c[k]['sources']] "
                "for k in ('data', 'validation')))))")
        ref = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "configs", "llama3_8b.toml")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HOME": str(tmp / "hf_ref"),
                                                                               "HF_HUB_OFFLINE": "0"})
        assert ref.returncode == 0, ref.stderr[-3000:]
        reference, one_resolution = json.loads(ref.stdout), sorted(api_requests(hub.log))
        hub.log.clear()
        config = tmp / "hub.toml"
        debug = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
        shipped = open(os.path.join(ROOT, "configs", "llama3_8b.toml")).read()  # its sources, and its validation one
        # (its [[phases]] are for the 8B model's sequence: left out, as are the debug config's)
        config.write_text(debug[:debug.index("[[data.sources]]")]
                          + shipped[shipped.index("[[data.sources]]"):shipped.index("\n[[phases]]")])
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "0"}
        args = ("--training.steps", 4, "--data.num_workers", 2, "--validation.freq", 4, "--validation.sequences", 8,
                "--validation.local_batch_size", 4)
        train(config, tmp / "dump", *args, nproc=2, env=env)
        first_start, first = sorted(api_requests(hub.log)), losses(tmp / "dump")
        manifest = json.load(open(tmp / "dump" / "data_manifest.json"))
        pinned = {repo: r["refs"]["main"] for repo, r in repos.items()}
        for repo, shards in [("allenai/c4", [p for p in repos["allenai/c4"]["commits"][pinned["allenai/c4"]]
                                              if p.startswith("en/c4-train.")] + ["en/c4-train.00000-of-00000.json.gz"]),
                             ("Zyphra/Zyda-2", [p for p in repos["Zyphra/Zyda-2"]["commits"][pinned["Zyphra/Zyda-2"]]
                                                if p.endswith(".parquet")] + ["data/fwe3/global-shard_00/a.parquet"]),
                             ("HuggingFaceTB/finemath", ["finemath-3plus/train-00000-of-00002.parquet"])]:
            # every shard read so far gets other documents, and a shard that sorts first appears
            push(repos, repo, {p: (_jsonl_gz if p.endswith(".gz") else _parquet)(
                [{"text": f"pushed later {p} {i} " * 50} for i in range(30)]) for p in shards})
        hub.log.clear()
        out = train(config, tmp / "dump", *args, "--checkpoint.load_step", 2, nproc=2, env=env)
        resume = list(hub.log)
        yield {"one_resolution": one_resolution, "first_start": first_start, "reference": reference,
               "manifest": manifest, "first": first, "replay": losses(tmp / "dump")[len(first):], "resume": resume,
               "pinned": pinned, "out": out}
    finally:
        hub.close()
        mp.undo()


@pytest.mark.slow
def test_a_2x2_job_resolves_each_source_once_and_its_resume_lists_nothing(hub_job):
    # the whole first start (2 ranks, 4 loader workers, training and validation) asks the Hub for what one
    # resolution in one process asks, and nothing more: every other process read the files from the manifest
    assert hub_job["first_start"] == hub_job["one_resolution"]
    assert sum("/tree/" in p for p in hub_job["first_start"]) >= 7  # the listings happened, once
    assert api_requests(hub_job["resume"]) == []  # the resume lists nothing: only file bytes are read
    assert [r for r in hub_job["resume"] if r["path"].endswith((".parquet", ".json.gz"))]
    # two resolutions of the same config give the same manifest: the run's equals the one made here
    assert hub_job["manifest"] == hub_job["reference"]
    assert [e["name"] for e in hub_job["manifest"]["validation"]] == ["c4"]
    assert len(hub_job["manifest"]["data"]) == 6 and all(len(e["commit"]) == 40 for e in hub_job["manifest"]["data"])


@pytest.mark.slow
def test_a_commit_pushed_between_save_and_resume_is_not_read(hub_job):
    """The resume reads the pinned commit: steps 3-4 are the uninterrupted run's, bit for bit."""
    assert [s for s, _ in hub_job["first"]] == [1, 2, 3, 4]
    assert hub_job["replay"] == hub_job["first"][2:]
    reads = [r["path"] for r in hub_job["resume"]]
    assert {repo for repo in hub_job["pinned"] if any(f"/{repo}/resolve/" in p for p in reads)} == \
        {"allenai/c4", "Zyphra/Zyda-2", "HuggingFaceTB/finemath"}
    assert all(f"/{repo}/resolve/{sha}/" in p for p in reads for repo, sha in hub_job["pinned"].items() if f"/{repo}/" in p)
    assert "new file" not in hub_job["out"]  # hub repos are not listed again, so not counted


@pytest.mark.slow
def test_a_run_moves_from_the_hub_to_a_mirror_that_download_data_py_made_and_stays_exact(tmp_path, monkeypatch):
    """A 2-rank run on Hub sources, 6 steps with a save at 3; `download_data.py` fetches what steps 1-6 read (killed
    once, then run again: finished files are not fetched again); the run resumes from step 3 with the Hub gone and
    HF_HUB_OFFLINE=1, reading the mirror: steps 4-6 are the Hub run's, bit for bit. Then a damaged mirror file."""
    repos = make_repos()
    hub, mirror, dump = Hub(repos), tmp_path / "mirror", tmp_path / "dump"
    debug = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    config = tmp_path / "hub.toml"
    config.write_text(debug[:debug.index("[[data.sources]]")] + '[[data.sources]]\nname = "c4"\npath = "allenai/c4"\n'
                      'data_files = "en/c4-train.*.json.gz"\n\n[[validation.sources]]\nname = "c4"\n'
                      'path = "allenai/c4"\nconfig = "en"\nsplit = "validation"\n')
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    args = ("--training.steps", 6, "--checkpoint.interval", 3, "--validation.freq", 6, "--validation.sequences", 4,
            "--validation.local_batch_size", 4)
    download = [sys.executable, "download_data.py", "--config", str(config), "--to", str(mirror), "--workers", 2,
                "--world_size", 2, "--job.dump_folder", str(dump), *TRAIN, *args]
    try:
        train(config, dump, *args, nproc=2, env=env)
        first, read = losses(dump), hub.bytes_served("/resolve/")
        # killed while the held-out file stalls, after the training files are in
        hub.log.clear()
        hub.stall_seconds, hub.faults = 20, {"c4-validation": ["stall"]}
        proc = subprocess.Popen(list(map(str, download)), cwd=ROOT, env={**os.environ, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while len(list(mirror.glob(".verified/**/*.json"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        proc.kill()
        out = proc.communicate()[0]
        assert len(list(mirror.glob(".verified/**/*.json"))) == 2, out
        fetched = {r["path"] for r in hub.log if "/resolve/" in r["path"] and r["bytes"]}
        hub.log.clear()
        again = subprocess.run(list(map(str, download)), cwd=ROOT, env={**os.environ, **env}, text=True,
                               capture_output=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        refetched = {r["path"] for r in hub.log if "/resolve/" in r["path"] and r["bytes"]}
        assert refetched and not refetched & fetched and all("c4-validation" in p for p in refetched)
        got = int(re.search(r"([\d,]+) bytes \(", again.stdout)[1].replace(",", ""))
    finally:
        hub.close()
    print(f"downloaded {got:,} bytes for steps 1-6; the Hub run read {read:,}")
    assert "--data.mirror" in again.stdout and 0 < got <= 1.5 * read
    offline = {**env, "HF_HUB_OFFLINE": "1"}  # and nothing answers at HF_ENDPOINT
    out = train(config, dump, *args, "--checkpoint.load_step", 3, "--data.mirror", mirror, nproc=2, env=offline)
    assert losses(dump)[len(first):] == first[3:], out
    # a truncated or damaged mirror file is one line naming it and the check
    manifest = json.load(open(dump / "data_manifest.json"))
    name, size = manifest["data"][0]["files"][0][:2]
    at = f"allenai/c4@{manifest['data'][0]['commit']}"  # the mirror's folder for the repo at the pinned commit
    url = f"{mirror}::hf://datasets/{at}/{name}"
    local = mirror / at / name
    original = local.read_bytes()
    local.write_bytes(original[:-1])
    with pytest.raises(DataError, match=rf"data mirror file {re.escape(str(local))} is {size - 1:,} bytes, not "
                                        rf"{size:,} \(size check\): delete it and run download_data.py again"):
        mirrors.open_file(url, size)
    local.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    with pytest.raises(DataError, match=r"is damaged \(sha256 check\)"):
        mirrors.open_file(url, size)
    os.remove(mirror / ".verified" / at / (name + ".json"))  # not in the mirror: offline, one line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=rf"{re.escape(str(local))} is not in the data mirror \(HF_HUB_OFFLINE=1\): "
                                        r"fetch it with python download_data.py --config C --world_size N --to"):
        mirrors.open_file(url, size)


def test_a_mirror_keeps_commits_apart_and_resumes_a_part_file_only_at_its_own_commit(tmp_path, monkeypatch):
    """A download killed at commit A (its part-file holds A's first bytes), run again after the file moved to commit
    B, gives B's bytes: never A's prefix with B's suffix, which a file outside LFS (no sha256 listed) would not
    show. Then A's copy is fetched too, resuming A's part-file, and each commit reads its own bytes offline."""
    def text(commit):  # the same size at both commits: the size check cannot tell them apart
        return "".join(json.dumps({"text": f"{commit} document {i} " * 20}) + "\n" for i in range(40)).encode()

    def url(commit):
        return f"hf://datasets/org/notes@{commit}/notes.jsonl"  # .jsonl: not in LFS at the fixture's Hub

    def killed(n):  # Ctrl-C once the first chunk is written
        raise KeyboardInterrupt

    repos = {"org/notes": {"commits": {"0" * 40: {}}, "refs": {"main": "0" * 40}}}  # an empty repo
    mirror, size = str(tmp_path / "mirror"), len(text("commit A"))
    a = push(repos, "org/notes", {"notes.jsonl": text("commit A")})
    hub = Hub(repos)
    point_libraries_at(hub.endpoint, monkeypatch, str(tmp_path / "cache"))
    monkeypatch.setattr(mirrors, "MIB", 1024)  # fetch_file writes 8 "MiB" = 8 KiB at a time
    try:
        with pytest.raises(KeyboardInterrupt):
            mirrors.fetch_file(mirror, url(a), size, 5.0, progress=killed)
        b = push(repos, "org/notes", {"notes.jsonl": text("commit B")})
        assert mirrors.fetch_file(mirror, url(b), size, 5.0) == size  # all of B's bytes, none of A's part
        assert mirrors.fetch_file(mirror, url(a), size, 5.0) == size - 8192  # A's part, resumed
    finally:
        hub.close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (and no Hub answers): read from the mirror or one line
    for commit, name in ((a, "commit A"), (b, "commit B")):
        with mirrors.open_file(f"{mirror}::{url(commit)}", size) as f:
            assert f.read() == text(name)


def test_download_data_fetches_the_files_the_stream_reads_first_and_more_for_more_tokens(tmp_path, monkeypatch):
    """In-process, one stream: a few tokens fetch the stream's first file; more tokens add the next ones in the order
    the stream reads them (the seed's shuffle), without fetching the first again."""
    hub = Hub(make_repos())
    point_libraries_at(hub.endpoint, monkeypatch, str(tmp_path / "cache"))
    debug = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    (tmp_path / "c4.toml").write_text(debug[:debug.index("[[data.sources]]")] + '[[data.sources]]\nname = "c4"\n'
                                      'path = "allenai/c4"\ndata_files = "en/c4-train.*.json.gz"\n')
    args = ["--config", str(tmp_path / "c4.toml"), "--to", str(tmp_path / "mirror"), "--workers", "1", "--world_size", "1",
            "--job.dump_folder", str(tmp_path / "dump"), "--data.num_streams", "1", "--validation.enable", "false",
            "--model.tokenizer_path", os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")]

    def fetched(tokens):
        hub.log.clear()
        download_data.main(args + ["--tokens", str(tokens)])
        return [r["path"].rsplit("/", 1)[1] for r in hub.log if "/resolve/" in r["path"] and r["bytes"]
                and r["path"].endswith(".json.gz")]  # not the dataset card, read by the resolution

    try:
        few, more = fetched(1000), fetched(150_000)
    finally:
        hub.close()
    manifest = json.load(open(tmp_path / "dump" / "data_manifest.json"))
    src = DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz")
    order = [os.path.basename(u) for u, _ in data.SourceReader(src, data_manifest.source_files(manifest, src), 0, 1,
                                                                1234)._files()]
    assert few == order[:1] and 1 < len(few + more) < len(order) and few + more == order[:len(few + more)]


# ---------------------------------------------------------------------------------------------------
# Local folders, a manifest made by download_data.py on a "login node", HF_HUB_OFFLINE=1
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline_job(tmp_path_factory):
    """`download_data.py --manifest` over copies of the bundled folders, then a 1-process run that uses it with
    HF_HUB_OFFLINE=1: 4 steps, checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("offline_job")
    shutil.copytree(os.path.join(ROOT, "assets", "data"), tmp / "data")
    text = open(os.path.join(ROOT, "configs", "debug_model.toml")).read().replace('"assets/data/', f'"{tmp}/data/')
    (tmp / "local.toml").write_text(text)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing to reach
    made = subprocess.run([sys.executable, "download_data.py", "--config", str(tmp / "local.toml"), "--manifest",
                           str(tmp / "pinned.json")], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert made.returncode == 0, made.stderr
    args = ("--data.manifest", tmp / "pinned.json", "--training.steps", 4, "--validation.freq", 4)
    out = train(tmp / "local.toml", tmp / "dump", *args, env={"HF_HUB_OFFLINE": "1"})
    return tmp, args, out, made.stdout


@pytest.mark.slow
def test_download_data_manifest_then_an_offline_run_trains_and_resumes_exactly_with_a_new_shard(offline_job):
    tmp, args, out, made = offline_job
    assert "wrote" in made and "sha256" in made and "c4:" in made
    assert not os.path.exists(tmp / "dump" / "data_manifest.json")  # the given manifest is the run's
    first = losses(tmp / "dump")
    assert [s for s, _ in first] == [1, 2, 3, 4]
    # a shard whose name sorts first lands in the C4 folder: not read, and said once at start
    c4 = tmp / "data" / "c4" / "en"
    shutil.copy(c4 / "c4-train.00001-of-00002.json.gz", c4 / "c4-train.00000-of-00000.json.gz")
    # and a held-out set added on resume is pinned then: the training data alone is the resume key
    (tmp / "more.toml").write_text((tmp / "local.toml").read_text() + f'\n[[validation.sources]]\nname = "added"\n'
                                   f'path = "{tmp}/data/c4"\ndata_files = "en/c4-validation.*.json.gz"\n')
    out = train(tmp / "more.toml", tmp / "dump", *args, "--checkpoint.load_step", 2, env={"HF_HUB_OFFLINE": "1"})
    assert losses(tmp / "dump")[len(first):] == first[2:]
    assert "data source 'c4': 1 new file(s)" in out and "checkpoint.initial_load_path" in out
    assert "validation source(s) added pinned now" in out
    last = [json.loads(ln) for ln in open(tmp / "dump" / "metrics.jsonl")][-1]
    assert "added" in last["validation_source_loss"]
    os.remove(c4 / "c4-train.00000-of-00000.json.gz")


@pytest.mark.slow
@pytest.mark.parametrize("same_size", [False, True])
def test_a_shard_replaced_by_other_bytes_is_one_line_and_nothing_is_written(offline_job, same_size, tmp_path):
    tmp, args, _, _ = offline_job
    dump = tmp_path / "dump"
    shutil.copytree(tmp / "dump", dump)
    shard = tmp / "data" / "finemath" / "finemath-3plus" / "train-00001-of-00002.parquet"
    original = shard.read_bytes()
    try:
        if same_size:  # other bytes in the middle of the file: the same size, the same modification time
            stat = os.stat(shard)
            middle = len(original) // 2
            shard.write_bytes(original[:middle] + bytes(b ^ 0xFF for b in original[middle:middle + 16]) +
                              original[middle + 16:])
            os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        else:
            shard.write_bytes(original + b"\0")
        before = sorted(os.listdir(dump / "checkpoint")), (dump / "metrics.jsonl").read_bytes()
        out = train(tmp / "local.toml", dump, *args, "--training.steps", 6, env={"HF_HUB_OFFLINE": "1"}, expect=2)
    finally:
        shard.write_bytes(original)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out
    assert f"data source 'finemath': {shard} changed" in errors[0], out
    assert ("same size" in errors[0]) == same_size and ("bytes)" in errors[0]) != same_size
    assert (sorted(os.listdir(dump / "checkpoint")), (dump / "metrics.jsonl").read_bytes()) == before


# ---------------------------------------------------------------------------------------------------
# In-process: the manifest's own rules (no training)
# ---------------------------------------------------------------------------------------------------

def test_manifest_of_local_folders_is_deterministic_and_readers_use_only_its_files(tmp_path, monkeypatch):
    shutil.copytree(os.path.join(ROOT, "assets", "data", "c4"), tmp_path / "c4")
    src = DataSource(name="c4", path=str(tmp_path / "c4"), data_files="en/c4-train.*.json.gz")
    a, b = data_manifest.make_manifest([src]), data_manifest.make_manifest([src])
    assert a == b and data_manifest.manifest_sha256(a) == data_manifest.manifest_sha256(b)
    assert [f[0] for f in a["data"][0]["files"]] == ["en/c4-train.00000-of-00002.json.gz",
                                                     "en/c4-train.00001-of-00002.json.gz"]
    data_manifest.write_manifest(a, str(tmp_path / "m.json"))
    assert json.load(open(tmp_path / "m.json")) == a
    # with a manifest, nothing is resolved again: not by the loader, nor its workers, nor the held-out reader
    monkeypatch.setattr(data_manifest, "resolve_files", lambda *args: pytest.fail("resolved again"))
    tok = data.Tokenizer(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"))
    loader = data.DataLoader([src], tok, 64, 2, 0, 1, num_streams=1, num_workers=1, manifest=a)
    next(loader)
    loader.close()
    assert data.heldout_windows(src, tok, 64, 2, {"validation": a["data"]})


def test_manifest_errors_are_one_line(tmp_path):
    src = DataSource(name="c4", path=os.path.join(ROOT, "assets", "data", "c4"), data_files="en/c4-train.*.json.gz")
    with pytest.raises(DataError, match=r"data manifest .*missing.json cannot be used: .*download_data.py --config C --manifest"):
        data_manifest.pinned_manifest(str(tmp_path / "missing.json"), str(tmp_path), [src], [])
    data_manifest.write_manifest(data_manifest.make_manifest([src]), str(tmp_path / data_manifest.MANIFEST))
    other = DataSource(name="c4", path=src.path, data_files="en/c4-validation.*.json.gz")
    with pytest.raises(DataError, match="has no data source 'c4' as configured .* made for other sources") as e:
        data_manifest.pinned_manifest("", str(tmp_path), [other], [])
    assert "\n" not in str(e.value)
    manifest = data_manifest.pinned_manifest("", str(tmp_path), [src], [])
    assert data_manifest.verify_manifest(manifest) == ""
    manifest["data"][0]["files"][0][0] = "en/gone.json.gz"
    assert re.match(r"data source 'c4': .*en/gone.json.gz is missing since this run's data manifest",
                    data_manifest.verify_manifest(manifest))
    assert data_manifest.verify_manifest(manifest, part=0, parts=2) == ""  # the other rank's share is intact


def test_validation_sources_are_pinned_when_first_used_and_are_no_resume_key(tmp_path, monkeypatch):
    c4 = os.path.join(ROOT, "assets", "data", "c4")
    src = DataSource(name="c4", path=c4, data_files="en/c4-train.*.json.gz")
    held = DataSource(name="held", path=c4, data_files="en/c4-validation.*.json.gz")
    first = data_manifest.pinned_manifest("", str(tmp_path), [src], [])
    later = data_manifest.pinned_manifest("", str(tmp_path), [src], [held])
    assert [e["name"] for e in later["validation"]] == ["held"]
    assert json.load(open(tmp_path / data_manifest.MANIFEST)) == later  # pinned in the run's manifest
    assert data_manifest.manifest_sha256(later) == data_manifest.manifest_sha256(first)
    # a manifest that cannot be written (a full disk) is one line, and leaves no temporary file behind

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DataError, match=r"cannot write the data manifest .*No space left on device; free space"):
        data_manifest.pinned_manifest("", str(tmp_path / "full"), [src], [])
    assert os.listdir(tmp_path / "full") == []


# ---------------------------------------------------------------------------------------------------
# Two "nodes" on one machine: two processes launched as Slurm would (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE=1)
# ---------------------------------------------------------------------------------------------------

def two_nodes(tmp_path, cwd: list, config: str, *args, env=None) -> list:
    """Start rank 0 and rank 1 of a 2-rank job, one per "node" (its own working directory and Slurm node name,
    node0 and node1), with the bundled tokenizer; return the two processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tokenizer = os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")
    return [subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--config", config, "--job.dump_folder",
                              str(tmp_path / "dump"), "--model.tokenizer_path", tokenizer, "--training.steps", "1",
                              *map(str, args)], cwd=cwd[rank], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                                  "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
                                  "SLURMD_NODENAME": f"node{rank}", **(env or {})}) for rank in (0, 1)]


@pytest.mark.slow  # two launches of train.py: 10 s of CPU importing torch, too much for the quick tier
def test_every_node_checks_every_local_file_of_its_own_copy(tmp_path, monkeypatch):
    """Each node has its own copy of the data at the same (relative) path; node 1's copy of one file differs.
    The ranks' split of the files would leave that file to rank 0, on node 0: each node checks all of them."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        shutil.copytree(os.path.join(ROOT, "assets", "data"), node / "assets" / "data")
    monkeypatch.chdir(nodes[0])
    debug = tomllib.load(open(os.path.join(ROOT, "configs", "debug_model.toml"), "rb"))
    m = data_manifest.make_manifest(*([DataSource(**t) for t in debug[k]["sources"]] for k in ("data", "validation")))
    local = sorted({(e["name"], e["path"], f[0]) for e in m["data"] + m["validation"] for f in e["files"]})
    damaged = nodes[1] / local[0][1] / local[0][2]  # the first: rank 0's share under a split over the job's ranks
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    procs = two_nodes(tmp_path, nodes, os.path.join(ROOT, "configs", "debug_model.toml"))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    errors = [ln for out in outs for ln in out.splitlines() if ln.startswith("error:")]
    # node 1's fault, not the config's: exit 4, and the line names the node a restart leaves out
    assert [p.returncode for p in procs] == [4, 4] and len(errors) == 2 and errors[0] == errors[1], outs
    assert errors[0].startswith("error: node node1: data source ")
    assert f"{local[0][1]}/{local[0][2]} changed (other bytes, same size)" in errors[0]


@pytest.mark.slow
def test_ranks_waiting_for_rank_0s_resolution_stop_at_their_own_deadline_with_one_line(tmp_path, monkeypatch):
    """Rank 0 resolves a Hub source that does not answer (a rate-limited Hub): rank 1 waits
    data.resolve_timeout_seconds, not the collectives' timeout, and says why in one line."""
    hub = Hub(make_repos())
    try:
        hub.stall_seconds, hub.faults = 120, {"/api/datasets/": ["stall"]}
        config = tmp_path / "hub.toml"
        debug = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
        config.write_text(debug[:debug.index("[[data.sources]]")] + '[[data.sources]]\nname = "c4"\n'
                          'path = "allenai/c4"\ndata_files = "en/c4-train.*.json.gz"\n')
        t0 = time.time()
        procs = two_nodes(tmp_path, [ROOT, ROOT], str(config), "--data.resolve_timeout_seconds", 3,
                          "--comm.init_timeout_seconds", 600, "--validation.enable", "false",
                          env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"})
        out = procs[1].communicate(timeout=300)[0]
        procs[0].kill()  # still waiting for the Hub: in a real job the launcher stops it
        procs[0].communicate()
    finally:
        hub.close()
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert procs[1].returncode == 4 and len(errors) == 1 and "Traceback" not in out, out  # a slow Hub: retried
    assert "rank 1 waited data.resolve_timeout_seconds = 3 s for rank 0" in errors[0]
    assert "--manifest PATH" in errors[0] and time.time() - t0 < 60


def test_rank_0s_manifest_reaches_a_rank_through_the_store_and_a_dropped_source_is_not_checked(tmp_path):
    """Rank 1 of a 2-rank job (a fake process group in this process) reads rank 0's manifest from the job's c10d
    store: no process group is made for it (gloo's would connect to every rank, and here would wait for a rank 0
    that is not there). A validation source the config dropped, whose files are gone, is not checked."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers the "fake" backend)

    import train
    from pretrain import startup
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--job.dump_folder",
                             str(tmp_path), "--data.resolve_timeout_seconds", "3"])
    manifest = data_manifest.make_manifest(cfg.data.sources, cfg.validation.sources)
    gone = {"name": "old", "path": str(tmp_path / "gone"), "config": None, "data_files": None, "split": "train",
            "revision": None, "commit": None, "files": [["a.jsonl", 10, "0" * 64]]}
    manifest["validation"].append(gone)
    dist.init_process_group("fake", store=dist.HashStore(), rank=1, world_size=2)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set("data_manifest_0", zlib.compress(json.dumps(manifest).encode()))  # as rank 0 does
        held_out = startup.held_out(cfg.validation, cfg.eval)
        shared = startup.share_manifest(cfg.data, held_out, str(tmp_path), 300, 1, torch.device("cpu"))
        assert shared == {**manifest, "mirror": cfg.data.mirror}
    finally:
        dist.destroy_process_group()
    old = DataSource(name="old", path=str(tmp_path / "gone"))
    assert "data source 'old': " in data_manifest.verify_manifest(manifest, sources=[*cfg.data.sources, old])
    assert data_manifest.verify_manifest(manifest, sources=cfg.data.sources) == ""


def test_the_changed_check_reads_only_the_ends_of_a_big_file(tmp_path):
    """The "changed" check reads the first and the last MiB, whatever the file's size."""
    big = tmp_path / "big.json.gz"
    big.write_bytes(gzip.compress(os.urandom(3 << 20), compresslevel=0))
    size = os.path.getsize(big)
    base = data_manifest.ends_sha256(str(big), size)
    raw = bytearray(big.read_bytes())
    raw[size // 2] ^= 0xFF  # the middle is not read: not seen (the size is, and a hub file is immutable)
    big.write_bytes(bytes(raw))
    assert data_manifest.ends_sha256(str(big), size) == base
    raw[-10] ^= 0xFF
    big.write_bytes(bytes(raw))
    assert data_manifest.ends_sha256(str(big), size) != base
