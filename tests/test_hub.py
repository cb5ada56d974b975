"""data.py's hub path, offline: the shipped configs' hub ids streamed from a small Hub on 127.0.0.1.

huggingface_hub and datasets talk to tests/hub_fixture.py's server through HF_ENDPOINT; nothing leaves the
loopback interface. The repos are laid out like allenai/c4, Zyphra/Zyda-2 and HuggingFaceTB/finemath, so
the `config` / `data_files` values of configs/llama3_8b.toml resolve as they do on the real Hub.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from huggingface_hub import HfFileSystem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
from pretrain import evals  # noqa: E402
import train  # noqa: E402
from data import DataLoader, Tokenizer  # noqa: E402
from pretrain import config  # noqa: E402
from pretrain import data_manifest  # noqa: E402
from pretrain import sources  # noqa: E402
from pretrain.sources import DataError, DataSource  # noqa: E402
from hub_fixture import Hub, make_repos, point_libraries_at, write_mirror  # noqa: E402
from conftest import SMALL, run_training  # noqa: E402

TOKEN = "hf_testTokenThatMustNeverBePrinted123"
# What huggingface_hub 2.4 and datasets 5.2 asked for while these tests ran (the fixture serves these only).
ENDPOINTS = {"GET /api/agent-harnesses", "GET /api/datasets/{repo}", "GET /api/datasets/{repo}/revision/{rev}",
             "GET /api/datasets/{repo}/tree/{rev}?expand&recursive",
             "GET /api/datasets/{repo}/tree/{rev}/{path}?expand&recursive",
             "GET /api/datasets/{repo}/tree/{rev}/{path}?cursor&expand&recursive",
             "HEAD /datasets/{repo}/resolve/{rev}/{path}", "GET /datasets/{repo}/resolve/{rev}/{path}",
             "GET /datasets/{repo}/resolve/{rev}/{path} Range"}


@pytest.fixture(scope="module")
def repos():
    return make_repos()


@pytest.fixture
def hub(repos, monkeypatch, tmp_path):
    server = Hub(repos)
    point_libraries_at(server.endpoint, monkeypatch, str(tmp_path / "cache"))
    yield server
    server.close()
    if os.environ.get("HUB_ENDPOINTS_LOG"):  # to list what the libraries asked for across the tests
        with open(os.environ["HUB_ENDPOINTS_LOG"], "a") as f:
            f.writelines(e + "\n" for e in server.endpoints())
    unhandled = [r["path"] for r in server.log if r.get("unhandled")]
    assert not unhandled, f"the libraries asked for endpoints the test hub does not serve: {unhandled}"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"))


def shipped_sources() -> list:
    return train.load_config(["--config", os.path.join(ROOT, "configs", "llama3_8b.toml")]).data.sources


def batches(loader, n: int) -> list:
    return [next(loader)[0] for _ in range(n)]


def within(seconds: float, fn, *args):
    """fn(*args) in a thread: a call still running after `seconds` fails the test rather than hanging it (the
    thread is a daemon: it ends when the test's hub closes the connection it waits on, or with pytest)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # raised again in the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.slow
def test_shipped_hub_sources_stream_like_their_local_mirror_and_resume_exactly(hub, repos, tok, tmp_path):
    """The 8B config's six sources from the hub give the same tokens (so the same shares) as the same
    files in local folders, and a loader resumed from a state dict continues the stream exactly."""
    hub_sources = shipped_sources()
    mirrors = {r: write_mirror(repos, str(tmp_path / r.replace("/", "__")), r) for r in {s.path for s in hub_sources}}
    local_sources = [DataSource(**{**s.__dict__, "path": mirrors[s.path]}) for s in hub_sources]

    def make(sources):
        return DataLoader(sources, tok, 128, 4, 0, 1, num_streams=2, seed=7)

    local = make(local_sources)
    expected = batches(local, 60)
    from_hub = make(hub_sources)
    from_hub.check()
    got = batches(from_hub, 25)
    state = json.loads(json.dumps(from_hub.state_dict()))
    resumed = make(hub_sources)
    resumed.load_state_dict({int(k): v for k, v in state.items()})
    got += batches(resumed, 35)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert resumed.source_tokens() == local.source_tokens()
    assert all(n > 0 for n in local.source_tokens().values())
    print("endpoints used:\n  " + "\n  ".join(hub.endpoints()))
    assert set(hub.endpoints()) <= ENDPOINTS
    assert any("cursor" in r["path"] for r in hub.log), "the tree listing was not paginated"


def test_a_pinned_revision_is_read(hub, repos, tok):
    old = repos["allenai/c4"]["refs"]["v0.1"]
    for revision in ("v0.1", old):  # a tag or a commit sha
        src = DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz", revision=revision)
        text = tok.decode(next(DataLoader([src], tok, 64, 1, 0, 1, num_streams=1))[0][0].tolist())
        assert "old revision document 0" in text
    reads = [r["path"] for r in hub.log if r["path"].endswith(".json.gz")]
    assert reads and all(f"/resolve/{old}/" in p for p in reads)
    main = DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz")
    assert "old revision" not in tok.decode(next(DataLoader([main], tok, 64, 1, 0, 1, num_streams=1))[0][0].tolist())


def test_heldout_windows_from_c4s_validation_split(hub, tok):
    """What a [[validation.sources]] table for the real configs reads: C4's `en` config, split `validation`."""
    src = DataSource(name="c4", path="allenai/c4", config="en", split="validation")
    windows = data.heldout_windows(src, tok, 256)
    assert len(windows) >= 20 and all(len(w) == 257 for w in windows) and windows[0][0] == tok.bos_id
    assert [r for r in hub.log if "c4-validation" in r["path"]] and not [r for r in hub.log if "c4-train" in r["path"]]


@pytest.mark.slow
def test_resume_seeks_by_range_into_a_parquet_file(hub, tok):
    """A resume deep inside a parquet file reads its footer and one row group, not the file."""
    src = DataSource(name="dclm", path="Zyphra/Zyda-2", config="dclm_crossdeduped")

    def make():
        return DataLoader([src], tok, 512, 1, 0, 1, num_streams=1, seed=3)

    loader = make()
    while loader.streams[0].positions[0]["row"] < 400:
        next(loader)
    state = loader.state_dict()
    expected = batches(loader, 3)
    name = loader.streams[0].readers[0]._files()[state[0]["readers"][0]["file"]][0].rsplit("/", 1)[1]
    start = len(hub.log)
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(batches(resumed, 3), expected))
    reads = [r for r in hub.log[start:] if r["path"].endswith(name) and r["method"] == "GET"]
    served = sum(r["bytes"] for r in reads)
    size = reads[0]["size"]
    print(f"resumed at row {state[0]['readers'][0]['row']}: {served:,} of {size:,} bytes served "
          f"({served / size:.1%}) in {len(reads)} range requests")
    assert all(r["range"] for r in reads) and served < 0.1 * size


def test_transient_answers_are_retried_with_backoff(hub, tok, monkeypatch):
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)  # the libraries' and data.py's pauses, recorded, not slept
    sources = [DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz"),
               DataSource(name="fm", path="HuggingFaceTB/finemath", config="finemath-3plus")]
    # more consecutive failures than huggingface_hub's own 5 retries of a listing; a file read is retried by data.py
    hub.faults = {"/api/datasets/allenai/c4/revision": [503, 502], "/tree/": [429],
                  "c4-train.": [503] * 7, "finemath-3plus/train-": [500, 429, 504, 503, 503, 503, 500]}
    got = batches(DataLoader(sources, tok, 128, 1, 0, 1, num_streams=1), 30)
    assert not any(hub.faults.values()), f"faults not reached: {hub.faults}"
    expected = batches(DataLoader(sources, tok, 128, 1, 0, 1, num_streams=1), 30)  # the faults are used up
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert len(sleeps) >= 10 and max(sleeps) > min(sleeps)  # growing pauses


@pytest.mark.slow
def test_a_stalled_redirected_or_whole_file_answer_gives_the_same_batches(hub, tok):
    """A read that gets no byte for `timeout` seconds (before the answer, or mid-body) is retried (the file
    re-opened where the stream was); reads follow the Hub's redirect to its CDN with their Range; a server that
    ignores Range sends the whole file, whose bytes are used. The batches equal those of a Hub that did none of
    this. An answer that is neither the bytes asked for nor the whole file is refused, never misread."""
    srcs = [DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz"),
            DataSource(name="dclm", path="Zyphra/Zyda-2", config="dclm_crossdeduped")]
    manifest = data_manifest.make_manifest(srcs)
    expected = batches(DataLoader(srcs, tok, 128, 1, 0, 1, num_streams=1, manifest=manifest), 20)
    hub.stall_seconds, hub.redirect, start = 5, True, len(hub.log)
    hub.faults = {"/cdn/": ["stall", "cut", "whole", "stall"]}
    t0 = time.perf_counter()
    got = batches(DataLoader(srcs, tok, 128, 1, 0, 1, num_streams=1, manifest=manifest, timeout=0.5), 20)
    assert not any(hub.faults.values()) and time.perf_counter() - t0 < 20
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    cdn = [r for r in hub.log[start:] if r["path"].startswith("/cdn/")]
    assert len(cdn) > 4 and all(r["range"] for r in cdn)
    c4 = manifest["data"][0]
    name, size = c4["files"][0][:2]
    hub.faults = {"/cdn/": ["whole"]}
    with pytest.raises(OSError, match=r"got HTTP 200 with .* not those bytes"):
        sources.HubFile(f"hf://datasets/allenai/c4@{c4['commit']}/{name}", size - 1, 1.0).read(100)


def test_a_transient_error_mid_file_refetches_its_range_only_after_the_pause_the_hub_asks_for(hub, repos, monkeypatch):
    """A 429 (Retry-After: 7), a 503 and a body cut off half-way, in the middle of a .json.gz read in 32 KiB ranges:
    each range is asked for again after its pause (a 429's at least its Retry-After), so the texts are those of a
    clean read and the Hub serves each byte of the file once (the decompressor kept its place: no re-read from
    byte 0). A Retry-After that the retry budget cannot hold ends the read at once, with one line."""
    sleeps = []
    clock = type("clock", (), {"monotonic": staticmethod(time.monotonic), "sleep": staticmethod(sleeps.append)})
    monkeypatch.setattr(sources, "time", clock)  # pretrain/sources.py's pauses recorded, not slept (the fixture's are real)
    monkeypatch.setattr(data, "MIB", 4096)  # the reader's 8 "MiB" ranges are 32 KiB: 4 to a file
    src = DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz")
    name, commit = "c4-train.00000-of-00004.json.gz", repos["allenai/c4"]["refs"]["main"]
    url = f"hf://datasets/allenai/c4@{commit}/en/{name}"  # as the manifest pins it (resolving costs 1 s)
    size = len(repos["allenai/c4"]["commits"][commit][f"en/{name}"])

    def read(**kw):
        start = len(hub.log)
        texts = list(data.SourceReader(src, [(url, size)], 0, 1, 0, ordered=True, **kw).texts(one_pass=True))
        return texts, [r for r in hub.log[start:] if name in r["path"]]

    clean, _ = read()
    hub.retry_after, hub.stall_seconds = "7", 2
    hub.faults = {name: [None, 429, None, 503, "cut"]}
    got, reads = read(timeout=0.3)
    assert got == clean and not hub.faults[name]
    ranges = [r["range"] for r in reads]
    assert ranges[1] == ranges[2] and ranges[3] == ranges[4] == ranges[5]  # the broken range, asked again
    assert sum(r["bytes"] for r in reads if r["status"] == 206) == size  # (a cut answer's half body: not counted)
    assert sleeps == [8, 1, 2]  # Retry-After + 1 s, as huggingface_hub waits; then the growing pauses of a new range
    hub.retry_after, hub.faults = "600", {name: [429]}
    with pytest.raises(DataError, match=r"^data source 'c4': reading hf://datasets/allenai/c4@\w+/en/c4-train.* "
                                        r"failed once .* another try \(the Hub asked for a pause of 600 s\) could end "
                                        r"past comm.init_timeout_seconds = 60 s"):
        read(budget=60)
    assert sleeps == [8, 1, 2]


def test_hub_refusals_end_with_one_line_naming_the_repo_and_what_to_do(hub, tok, monkeypatch):
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)

    def error(src) -> str:
        with pytest.raises(DataError) as e:
            DataLoader([src], tok, 64, 1, 0, 1, num_streams=1).check()
        assert "\n" not in str(e.value)
        return str(e.value)

    for src in [DataSource(name="c5", path="allenai/c5"),  # no such repo (401 without a token, as the Hub does)
                DataSource(name="gated", path="org/gated-set")]:  # gated, no token
        hub.tokens["org/gated-set"] = TOKEN
        msg = error(src)
        assert f"the Hub refused {src.path!r}" in msg and "hf auth login" in msg and "accept its terms" in msg
    assert "revision" in error(DataSource(name="c4", path="allenai/c4", revision="no-such-tag"))
    assert not sleeps  # refusals are not retried
    # a file that disappears (404) while reading: at once, one line
    hub.faults = {"finemath-3plus/train-": [404]}
    msg = error(DataSource(name="fm", path="HuggingFaceTB/finemath", config="finemath-3plus"))
    assert "the Hub refused 'HuggingFaceTB/finemath' (HTTP 404) while reading hf://" in msg and not sleeps
    # a server that stays down: the retries run out, then one line
    monkeypatch.setattr(sources, "RETRY_DELAYS", (1, 2))
    hub.faults = {"finemath-3plus/train-": [503] * 100}
    msg = error(DataSource(name="fm", path="HuggingFaceTB/finemath", config="finemath-3plus"))
    assert "failed 3 times (HfHubHTTPError" in msg and "503" in msg


@pytest.mark.slow
def test_a_stalled_listing_is_retried_and_ends_in_one_line_within_the_budget(hub, monkeypatch):
    """A listing page that never comes (the fixture keeps the connection open: huggingface_hub's client would wait
    forever) fails after the Hub timeout and is retried; one that keeps stalling ends the resolution with one line
    before the budget (comm.init_timeout_seconds) is spent."""
    monkeypatch.setattr(time, "sleep", lambda s: None)  # huggingface_hub's and pretrain/sources.py's pauses: the waits are real
    monkeypatch.setattr(sources, "RETRY_DELAYS", (0.01,) * 9)  # so that a retry of ours fits in the budget below
    src = DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz")
    hub.faults = {"/tree/": ["stall"]}
    assert len(within(15, data_manifest.resolve_source, src, 0.2)["files"]) == 4 and not hub.faults["/tree/"]
    HfFileSystem.clear_instance_cache()  # it keeps listings per thread, and thread ids are reused: list anew
    hub.faults, start, t0 = {"/tree/": ["stall"] * 1000}, len(hub.log), time.monotonic()
    with pytest.raises(DataError) as e:
        within(15, data_manifest.resolve_source, src, 0.2, 4.0)  # room for a second round of 1.3-2 s
    took, msg = time.monotonic() - t0, str(e.value)
    tries = len([r for r in hub.log[start:] if "/tree/" in r["path"]])  # huggingface_hub tries a page 6 times
    print(f"{tries} stalled requests, one line after {took:.1f} s: {msg}")
    # (took: under the budget give or take the last try, which is taken to last as long as the one before it)
    assert took < 4.5 and tries >= 12 and "\n" not in msg
    assert msg.startswith("data source 'c4': resolving the 'train' files of path='allenai/c4'")
    assert "Timeout" in msg and "comm.init_timeout_seconds = 4 s" in msg and "raise it" in msg


@pytest.mark.slow
def test_a_read_that_keeps_failing_gives_up_within_the_budget_with_one_line(hub, tok, monkeypatch):
    """While one rank retries a Hub read, the other ranks wait in a collective for up to comm.init_timeout_seconds:
    a read that keeps stalling gives up before that, with one line naming the source, the file and what to raise:
    the loader in the trainer's process and in a worker, the held-out and the eval readers."""
    monkeypatch.setattr(sources, "RETRY_DELAYS", (0.1,) * 9)
    src = DataSource(name="fm", path="HuggingFaceTB/finemath", config="finemath-3plus")
    manifest = data_manifest.make_manifest([src])
    manifest["validation"] = manifest["data"]
    hub.faults, budget = {"finemath-3plus/train-": ["stall"] * 1000}, 0.8

    def loader(workers):
        return DataLoader([src], tok, 64, 1, 0, 1, num_streams=1, num_workers=workers, manifest=manifest, timeout=0.1,
                          budget=budget)

    in_worker = loader(1)  # (a new process: its pauses are RETRY_DELAYS' own, and its first, 1 s, does not fit)
    reads = {"loader": loader(0).check, "worker": lambda: next(in_worker),
             "held-out": lambda: data.heldout_windows(src, tok, 64, 1, manifest, 0.1, budget),
             "eval": lambda: evals.read_examples(src, manifest, 1, 0.1, budget)}
    try:
        for name, read in reads.items():
            t0 = time.monotonic()
            with pytest.raises(DataError) as e:
                within(15, read)
            took, msg = time.monotonic() - t0, str(e.value)
            print(f"{name}: one line after {took:.1f} s: {msg}")
            # within the budget, give or take the last try's own few ms past its timeout; a worker starts up first
            assert name == "worker" or took < budget + 0.2
            # (a worker that took longer than the budget to start: its step's reads are over before they begin)
            step_over = msg.startswith("data source 'fm': the reads of one step took longer than "
                                       "comm.init_timeout_seconds = 0.8 s, ")
            assert (name == "worker" and step_over) or re.match(
                r"data source 'fm': reading hf://datasets/HuggingFaceTB/finemath@[0-9a-f]{40}/finemath-3plus/"
                r"train-0000\d-of-00002.parquet( at row 0)? failed (once|\d+ times) in \d+ s and stopped retrying: .* "
                r"comm.init_timeout_seconds = 0.8 s( for the reads of one step in all)?, .* raise it .*\(ReadTimeout",
                msg), msg
    finally:
        in_worker.close()


def test_the_reads_of_one_batch_end_within_the_budget_in_all(hub, tok, monkeypatch):
    """Each 512-byte range of a batch's C4 reads fails once (503) and is retried after a pause that fits in the
    budget (comm.init_timeout_seconds) by itself; the batch's ranges together would take longer, while the other
    ranks wait in a collective. The batch stops within the budget, with one line naming the file."""
    monkeypatch.setattr(sources, "RETRY_DELAYS", (0.4,) * 9)
    monkeypatch.setattr(data, "MIB", 64)  # the reader's 8 "MiB" ranges are 512 bytes: a batch reads about ten
    src = DataSource(name="c4", path="allenai/c4", data_files="en/c4-train.*.json.gz")
    manifest = data_manifest.make_manifest([src])
    loader = DataLoader([src], tok, 512, 8, 0, 1, num_streams=1, manifest=manifest, timeout=0.3, budget=1.5)
    hub.faults = {"c4-train.": [None, 503] * 10}  # each range's first try after the first range's: 0.4 s lost
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        within(15, next, loader)
    took, msg = time.monotonic() - t0, str(e.value)
    print(f"one line after {took:.1f} s: {msg}")
    assert took < 1.5 + 0.2 and "\n" not in msg
    assert re.match(r"data source 'c4': reading hf://datasets/allenai/c4@[0-9a-f]{40}/en/c4-train.0000\d-of-00004"
                    r".json.gz failed once in 0 s and stopped retrying: another try could end past "
                    r"comm.init_timeout_seconds = 1.5 s for the reads of one step in all, how long the other ranks "
                    r"wait for this one in a collective; raise it .*\(HfHubHTTPError", msg), msg
    assert loader.step[0] == float("inf")  # no step reads now: a read outside a batch is not bounded by it


@pytest.mark.slow
def test_a_loader_workers_reads_end_with_the_step_it_waits_in(hub, tok):
    """The same in a loader worker (a process of its own, with RETRY_DELAYS' pauses of 1, 2, 4 s): a parquet file's
    footer and then its row group each fail three times, 7 s of pauses each, within the budget of 8 s by itself.
    The worker's reads end with the step the trainer waits in (its start-up is inside too), with one line naming
    the file, not after the 14 s of both."""
    src = DataSource(name="dclm", path="Zyphra/Zyda-2", config="dclm_crossdeduped")
    manifest = data_manifest.make_manifest([src])
    loader = DataLoader([src], tok, 64, 1, 0, 1, num_streams=1, num_workers=1, manifest=manifest, timeout=0.5, budget=8)
    hub.faults = {"dclm_crossdeduped/": [503, 503, 503, None] * 2}
    t0 = time.monotonic()
    try:
        with pytest.raises(DataError) as e:
            within(30, next, loader)
    finally:
        loader.close()
    took, msg = time.monotonic() - t0, str(e.value)
    print(f"one line after {took:.1f} s: {msg}")
    assert took < 8 + 0.5 and "\n" not in msg
    assert re.match(r"data source 'dclm': reading hf://datasets/Zyphra/Zyda-2@[0-9a-f]{40}/data/dclm_crossdeduped/"
                    r".*\.parquet failed (once|\d times) in \d s and stopped retrying: another try could end past "
                    r"comm.init_timeout_seconds = 8 s for the reads of one step in all", msg), msg


def test_a_hub_read_must_fit_in_the_collectives_wait():
    """One Hub read may wait data.hub_timeout_seconds while the other ranks wait comm.init_timeout_seconds in a
    collective: a config with Hub sources where the first is not below the second is refused."""
    hub_cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "llama3_8b.toml"),
                                 "--comm.init_timeout_seconds", "60"])
    with pytest.raises(train.ConfigError, match=r"^data.hub_timeout_seconds = 60 must be below comm.init_timeout_"
                       r"seconds = 60 \(source '\w+' is on the Hub\)"):
        train.validate(hub_cfg, world_size=8)
    local = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"),
                               "--comm.init_timeout_seconds", "10"])  # local folders only: no Hub read to wait for
    train.validate(local, world_size=1)


def test_hf_token_is_sent_as_a_header_and_never_printed(hub, tok, monkeypatch, capsys, caplog):
    hub.tokens["org/gated-set"] = TOKEN
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    src = DataSource(name="gated", path="org/gated-set")
    assert "gated" in tok.decode(next(DataLoader([src], tok, 32, 1, 0, 1, num_streams=1))[0][0].tolist())
    gated = [r for r in hub.log if "org/gated-set" in r["path"]]
    assert gated and all(r["auth"] == f"Bearer {TOKEN}" for r in gated)
    monkeypatch.setenv("HF_TOKEN", TOKEN[:-1])  # a wrong token: refused, and the line does not echo it
    with pytest.raises(DataError) as e:
        DataLoader([src], tok, 32, 1, 0, 1, num_streams=1).check()
    out = capsys.readouterr()
    assert TOKEN[:-1] not in str(e.value) + out.out + out.err + caplog.text


@pytest.mark.slow
def test_bench_loader_streams_the_8b_config_from_the_hub(hub, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"), HF_TOKEN=TOKEN)
    out = subprocess.run([sys.executable, "bench.py", "loader", "--config", "configs/llama3_8b.toml", "--tokens", "40000",
                          "--model.tokenizer_path", "assets/tokenizer/tokenizer.model"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    for name in ("zyda2_dclm", "zyda2_fineweb_edu", "zyda2_dolma_cc", "zyda2_zyda", "c4", "finemath"):
        assert f"{name}: " in out.stdout
    assert "share" in out.stdout and "tokens/s" in out.stdout and "2 worker(s)" in out.stdout
    assert TOKEN not in out.stdout + out.stderr
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.log if r["path"].startswith("/datasets/"))


@pytest.mark.slow
def test_train_py_on_the_shipped_hub_sources_trains_resumes_and_eats_the_mirrors_tokens(hub, repos, tok, tmp_path):
    """The debug model trained by train.py on the 8B config's six hub sources and its C4 validation split: it
    trains, a resume from step 2 replays steps 3-4 exactly, the tokens it eats per source are those a loader
    reads from local mirrors of the same files, and HF_TOKEN reaches neither the output nor the dump folder."""
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--validation.sequences", "4",
                             "--validation.local_batch_size", "4"])
    cfg.data.sources = shipped_sources()
    cfg.validation.sources = train.load_config(["--config", os.path.join(ROOT, "configs", "llama3_8b.toml")]
                                               ).validation.sources
    (tmp_path / "hub.toml").write_text(config.to_toml(cfg))
    env = {"HF_HUB_OFFLINE": None, "HF_DATASETS_OFFLINE": None, "HF_ENDPOINT": hub.endpoint,
           "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}  # None: unset
    dump = tmp_path / "dump"

    def run(*args):
        # SMALL's 64 tokens a sequence, 8 sequences a step: the 512 tokens a step of 4 x 128 read before
        proc = run_training(["--config", tmp_path / "hub.toml", "--job.dump_folder", dump, "--training.steps", "4",
                             *SMALL, "--training.local_batch_size", "8", "--metrics.log_freq", "1",
                             "--checkpoint.enable", "--checkpoint.interval", "2", "--validation.freq", "4", *args],
                            env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert TOKEN not in proc.stdout + proc.stderr
        return [json.loads(ln) for ln in open(dump / "metrics.jsonl")]

    # The first run reads in the trainer's process, the resume in a loader worker (each spawned worker spends
    # 4.5 s of CPU importing torch): a resume may change the worker count, and the stream is the same.
    first = run("--data.num_workers", "0")
    steps = [r for r in first if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["loss"] < steps[0]["loss"]
    assert [r["validation_source_loss"] for r in first if "validation_loss" in r][0].keys() == {"c4"}
    # The resume's reads go through a CDN redirect, and two of them stall (before the answer, and mid-body):
    # the loader worker retries them for the same bytes, so steps 3-4 come out the same.
    hub.stall_seconds, hub.redirect, hub.faults = 10, True, {"/cdn/": ["stall", "cut"]}
    resumed = run("--data.num_workers", "1", "--checkpoint.load_step", "2", "--data.hub_timeout_seconds", "1")
    replay = [r for r in resumed[len(first):] if "loss" in r]
    assert [(r["step"], r["loss"]) for r in replay] == [(r["step"], r["loss"]) for r in steps[2:]]
    assert not any(hub.faults.values())

    mirrors = {r: write_mirror(repos, str(tmp_path / r.replace("/", "__")), r) for r in {s.path for s in cfg.data.sources}}
    mirrored = [DataSource(**{**s.__dict__, "path": mirrors[s.path]}) for s in cfg.data.sources]
    local = DataLoader(mirrored, tok, 64, 8, 0, 1, num_streams=cfg.data.num_streams, seed=cfg.data.seed)
    batches(local, 4)
    # (2,080 tokens: the two big Zyda-2 sources' first documents; the loader test above covers all six)
    assert steps[-1]["source_tokens"] == local.source_tokens() and sum(n > 0 for n in local.source_tokens().values()) >= 2
    for name in ("config.toml", "metrics.jsonl"):
        assert TOKEN not in (dump / name).read_text()
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.log if r["path"].startswith("/datasets/"))
