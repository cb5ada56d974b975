"""download_data.py sized for the real job (issue 43, item 5), in-process and without a Hub: it asks for the world size
when the batch or the streams follow it, or takes it from the config's fixed degrees; it estimates tokens per byte
from a sample of a source's first file; an error or Ctrl-C stops every fetch at its next chunk. The fetches
themselves (a local Hub, a killed download resumed) are tested in tests/test_manifest.py."""

import gzip
import json
import os
import signal
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import download_data  # noqa: E402
import train  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402
from data import Tokenizer  # noqa: E402
from pretrain.sources import DataError, DataSource  # noqa: E402

LLAMA3_8B = os.path.join(ROOT, "configs", "llama3_8b.toml")
# the llama3_* configs fix the batch and the streams; these tests' run leaves both to the layout
BY_LAYOUT = ["--training.global_batch_size", "-1", "--data.num_streams", "0"]
TOKENIZER = os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")


def test_a_batch_that_follows_the_world_size_needs_world_size(tmp_path, monkeypatch):
    """A config that leaves the batch and the streams to the layout: without --world_size, one line (exit 2 in
    __main__), before any listing or fetch."""
    monkeypatch.setattr(download_data, "download", lambda *a: pytest.fail("it went on to download"))
    with pytest.raises(ConfigError) as e:
        download_data.main(["--config", LLAMA3_8B, *BY_LAYOUT, "--to", str(tmp_path / "mirror")])
    assert str(e.value).startswith("--world_size is missing: this config's batch or data streams follow the number "
                                   "of GPUs") and "\n" not in str(e.value), e.value


def test_fixed_degrees_give_the_world_size(tmp_path, monkeypatch):
    """Degrees that fix the layout (2 x 16 x 2) give the world size (64), its global batch (local 1 x dp 32) and
    streams (one per dp rank): the whole run's tokens are fetched for, not one GPU's."""
    got = {}
    monkeypatch.setattr(download_data, "download", lambda cfg, held_out, tokens, shares, streams, to, workers: got.update(
        tokens=tokens, streams=streams))
    fixed = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "16",
             "--parallelism.tensor_parallel_degree", "2"]
    download_data.main(["--config", LLAMA3_8B, *BY_LAYOUT, "--to", str(tmp_path / "mirror"), *fixed])
    cfg = train.load_config(["--config", LLAMA3_8B, *BY_LAYOUT, *fixed])
    # every phase's tokens (its [[phases]] ramp the sequence 4,096 -> 8,192 and the batch 32 -> 128): 7.1B
    assert got == {"tokens": train.validate(cfg, 64)["phases"].tokens_through(10_000), "streams": 32}, got
    assert 10_000 * 32 * 4096 < got["tokens"] < 10_000 * 128 * 8192
    assert download_data.world_size(cfg, 0) == 64
    assert download_data.world_size(cfg, 64) == 64  # --world_size, when given, is the run's (validate checks it)
    assert download_data.world_size(train.load_config(["--config", LLAMA3_8B]), 0) == 1  # its fixed batch: none needed


@pytest.mark.parametrize("path, share", [("c4/en/c4-train.00000-of-00002.json.gz", 3 / 4),
                                         ("finemath/finemath-3plus/train-00000-of-00002.parquet", 1 / 4)])
def test_tokens_per_byte_from_a_sample_is_the_whole_files(path, share, monkeypatch):
    """A sample of a share of the file's tokens (SAMPLE_TOKENS: 2M, of ~150M in a real C4 shard) gives the whole
    file's tokens per byte within 8%, and only the sample is tokenized (a whole real shard would take minutes).
    Why not closer, on these small files: the gzip reader reads 8 KiB of input ahead of the lines it returns
    (Python 3.11), counted as sampled: ~5% of a 170 KB sample (measured 0.912 against 0.951), 0.3% of a real 2M
    tokens' ~3 MB; parquet's estimate takes the sampled rows' share of the file as their bytes' share, and this
    file's documents vary in length (a 3/4 sample reads +7.6%, 1/4 +2.2%)."""
    full = os.path.join(ROOT, "assets", "data", path)
    tokenizer, size = Tokenizer(TOKENIZER), os.path.getsize(full)
    if path.endswith(".parquet"):
        texts = pq.ParquetFile(full).read(columns=["text"]).column(0).to_pylist()  # (read_table: 2 s of imports)
    else:
        texts = [json.loads(line)["text"] for line in gzip.open(full)]
    whole = sum(len(tokenizer.encode(t)) for t in texts)
    monkeypatch.setattr(download_data, "SAMPLE_TOKENS", int(whole * share))
    encoded = []
    counting = type("Counting", (), {"encode": lambda self, text: encoded.append(tokenizer.encode(text)) or
                                     encoded[-1]})()
    src = DataSource(name="sample", path=os.path.dirname(full), text_column="text")
    estimate = download_data.tokens_per_byte(full, size, src, counting)
    print(f"{path}: sample {estimate:.4f} tokens/byte, whole file {whole / size:.4f}")
    assert estimate == pytest.approx(whole / size, rel=0.08)
    assert int(whole * share) <= sum(map(len, encoded)) < whole * (share + 0.1)  # it stopped after the sample


def fake_fetches(started: list, chunks_after_stop: list, stopped: threading.Event):
    """A fetch_file that fails on URLs ending in 'bad' after 0.2 s (setting `stopped`), and on others sends 1 byte
    chunks every 10 ms for up to 10 s (a big file), counting the chunks it sends after `stopped` is set."""
    def fetch_file(mirror, url, size, timeout, budget, progress):
        started.append(url)
        if url.endswith("bad"):
            time.sleep(0.2)
            stopped.set()
            raise DataError("the Hub refused bad")
        for _ in range(1000):
            chunks_after_stop.append(1) if stopped.is_set() else None
            progress(1)
            time.sleep(0.01)
        return size
    return fetch_file


@pytest.mark.parametrize("how", ["error", "ctrl-c"])
def test_an_error_or_ctrl_c_stops_every_fetch_at_its_next_chunk(how, tmp_path, monkeypatch):
    """3 workers, 5 files: a failing fetch (or Ctrl-C in the main thread) ends the running ones at their next chunk
    and the queued ones never start; fetch() returns (raises) within a second, not after the big files."""
    started, after, stopped = [], [], threading.Event()
    monkeypatch.setattr(download_data, "fetch_file", fake_fetches(started, after, stopped))
    big = [(f"hf://datasets/org/set@{'0' * 40}/big-{i}", 10**9) for i in range(4)]
    todo = ([(f"hf://datasets/org/set@{'0' * 40}/bad", 1)] if how == "error" else []) + big
    main = threading.main_thread().ident
    # Ctrl-C: SIGINT to the main thread, waiting for the fetches (Python raises KeyboardInterrupt there)
    timer = threading.Timer(0.2, lambda: (stopped.set(), signal.pthread_kill(main, signal.SIGINT)))
    # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start (a shell's `pytest &` ignores it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    if how == "ctrl-c":
        timer.start()
    try:
        with pytest.raises(DataError if how == "error" else KeyboardInterrupt):
            download_data.fetch(todo, str(tmp_path), 3, 1.0, 1.0)
    finally:
        stopped.set()
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    took = time.monotonic() - t0
    assert took < 1.5, took  # the fetches would run 10 s
    assert len(started) < len(todo), started  # the last one queued never started
    assert len(after) <= 10, after  # a chunk or two each, not 100 a second
