"""data.py: tokenizer, readers, token-weighted mixture, packing and exact resume (CPU, no network)."""

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data  # noqa: E402
from pretrain import data_manifest  # noqa: E402
from pretrain import sources as S  # noqa: E402
import train  # noqa: E402
from data import DataLoader, Tokenizer, heldout_windows  # noqa: E402
from pretrain.sources import DataError, DataSource  # noqa: E402

TOKENIZER = os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")
HELDOUT = [("c4", "assets/data/c4", "en/c4-validation.*.json.gz"),  # (name, path, data_files) as in a config
           ("zyda2_dclm", "assets/data/zyda2", "validation/dclm_crossdeduped/*.parquet"),
           ("zyda2_fwe3", "assets/data/zyda2", "validation/fwe3/*.parquet"),
           ("finemath", "assets/data/finemath", "validation/finemath-3plus/*.parquet")]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def sources():
    srcs = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml")]).data.sources
    for s in srcs:
        s.path = os.path.join(ROOT, s.path)
    return srcs


def test_tokenizer_roundtrip_and_llama3_specials(tok):
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (2048, 1792, 1793)
    text = "Hello world! 12345 naïve café\n\n  tabs\tand <|end_of_text|> as plain text"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.eos_id not in ids[1:-1]  # special-token strings in web text stay text
    assert tok.decode(ids[1:-1]) == text
    assert tok.special["<|eot_id|>"] == 1792 + 9 and tok.special["<|reserved_special_token_246|>"] == 2047


@pytest.mark.parametrize("content, message", [(None, "not found"), ("not base64 at all\n", "not a tiktoken BPE file")])
def test_bad_tokenizer_file(tmp_path, content, message):
    path = tmp_path / "tokenizer.model"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        Tokenizer(str(path))


def test_packing_bos_eos_and_windows(tok, sources):
    loader = DataLoader(sources, tok, 64, 4, 0, 1, num_streams=1)
    inputs, labels = next(loader)
    assert inputs.shape == labels.shape == (4, 64)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are inputs shifted by one
    assert inputs[0, 0] == tok.bos_id  # the first window starts a document
    flat = torch.cat([inputs[:, :1], labels], 1).flatten().tolist()
    # every EOS that is not the last token is followed by the next document's BOS
    assert all(flat[i + 1] == tok.bos_id for i, t in enumerate(flat[:-1]) if t == tok.eos_id)


def test_mixture_token_shares_within_one_point(tok, sources):
    loader = DataLoader(sources, tok, 256, 4, 0, 1, num_streams=1)
    while sum(loader.source_tokens().values()) < 1_000_000:
        next(loader)
    counts = loader.source_tokens()
    total = sum(counts.values())
    weights = {s.name: s.weight / sum(x.weight for x in sources) for s in sources}
    for name, c in counts.items():
        assert abs(c / total - weights[name]) < 0.01, (name, c / total, weights[name])


@pytest.mark.parametrize("streams", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_resume_is_exact_at_any_point(tok, sources, streams):
    """Restarts at several points (inside documents, after sources wrapped to epoch 1, twice in a
    row) give the uninterrupted stream. 4 streams over 2 files per source exercises the row split."""
    def make():
        return DataLoader(sources, tok, 256, 4, 0, 1, num_streams=streams, seed=5)

    reference = make()
    expected = [next(reference)[0] for _ in range(1200)]
    assert any(r["epoch"] > 0 for st in reference.streams for r in st.state_dict()["readers"])
    loader, got = make(), []
    for stop in (7, 333, 334, 1000):  # 333 -> 334: a second restart right after the first
        while len(got) < stop:
            got.append(next(loader)[0])
        # through JSON, as train.py stores each stream's state in the checkpoint
        state = {s: json.loads(json.dumps(sd)) for s, sd in loader.state_dict().items()}
        loader = make()
        loader.load_state_dict(state)
    while len(got) < len(expected):
        got.append(next(loader)[0])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_streams_are_disjoint_and_layout_independent(tok, sources):
    """Two ranks with one stream each see exactly what one rank with both streams sees."""
    both = DataLoader(sources, tok, 64, 8, 0, 1, num_streams=2)
    rank0, rank1 = (DataLoader(sources, tok, 64, 4, r, 2, num_streams=2) for r in (0, 1))
    for _ in range(20):
        x, _ = next(both)
        assert torch.equal(x, torch.cat([next(rank0)[0], next(rank1)[0]]))
    assert not torch.equal(next(rank0)[0], next(rank1)[0])


def step_rows(loaders, accumulation) -> list:
    """One step's windows from every rank's loader, as tuples, sorted: the global batch as a set."""
    return sorted(tuple(row.tolist()) for loader in loaders for _ in range(accumulation) for row in next(loader)[0])


def test_micro_batches_smaller_than_the_streams_take_them_in_turn_and_resume_on_fewer_ranks(tok, sources):
    """A global batch of 4 over 4 streams (a window from each per step), local_batch_size 1: 4 ranks take a window
    each; 2 ranks take their two streams in turn over 2 micro-batches; 1 rank its four over 4. Every layout's step is
    the same global batch, and the state after a step on 4 ranks resumes on 2 and on 1 exactly (a job that lost
    nodes). The old rule (local_batch_size a multiple of num_streams / DP) refused 2 ranks and 1."""
    def layout(dp, state=None):
        loaders = [DataLoader(sources, tok, 32, 1, r, dp, num_streams=4, seed=3) for r in range(dp)]
        for loader in loaders if state else []:
            loader.load_state_dict(state)
        return loaders

    four, one = layout(4), layout(1)
    for _ in range(3):  # one rank's micro-batch i is stream i's window, the one rank i of four takes
        assert all(torch.equal(next(one[0])[0], next(rank)[0]) for rank in four)
    two, again = layout(2), layout(4)
    assert all(step_rows(two, 2) == step_rows(again, 1) for _ in range(3))
    state = {s: json.loads(json.dumps(sd)) for loader in four for s, sd in loader.state_dict().items()}
    want = [step_rows(four, 1) for _ in range(5)]
    two, one = layout(2, state), layout(1, state)
    assert [step_rows(two, 2) for _ in range(5)] == want and [step_rows(one, 4) for _ in range(5)] == want


def test_validate_takes_any_local_batch_when_the_streams_divide_the_global_batch():
    """train.validate's rule: num_streams a multiple of DP and a divisor of the global batch; local_batch_size
    free (1 on 1 process with 4 streams: 4 micro-batches a step). A global batch the streams do not divide: one line."""
    debug = ["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--training.local_batch_size", "1"]
    cfg = train.load_config([*debug, "--training.global_batch_size", "4", "--data.num_streams", "4"])
    assert train.validate(cfg, 1)["grad_accum"] == 4
    cfg = train.load_config([*debug, "--training.global_batch_size", "6", "--data.num_streams", "4"])
    with pytest.raises(train.ConfigError) as e:
        train.validate(cfg, 1)
    assert str(e.value) == ("data.num_streams = 4 must be a multiple of the data-parallel degree 1 and divide "
                            "training.global_batch_size 6 (a step takes as many sequences from every stream)")


def test_local_json_and_parquet_folders_and_errors(tok, tmp_path):
    (tmp_path / "j").mkdir()
    with gzip.open(tmp_path / "j" / "a.json.gz", "wt") as f:
        for i in range(5):
            f.write(json.dumps({"body": f"json document {i}"}) + "\n")
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"content": [f"parquet document {i}" for i in range(5)]}), tmp_path / "p" / "x.parquet",
                   row_group_size=2)
    srcs = [DataSource(name="j", path=str(tmp_path / "j"), text_column="body", weight=1.0),
            DataSource(name="p", path=str(tmp_path / "p"), text_column="content", weight=1.0)]
    loader = DataLoader(srcs, tok, 32, 1, 0, 1, num_streams=1)
    text = tok.decode(torch.cat([next(loader)[0][0] for _ in range(10)]).tolist())
    assert "json document 0" in text and "parquet document 0" in text

    def first_batch(src):
        next(DataLoader([src], tok, 32, 1, 0, 1, num_streams=1))

    with pytest.raises(DataError, match="no column 'text'"):
        first_batch(DataSource(name="p", path=str(tmp_path / "p")))
    with pytest.raises(DataError, match="no key 'text'"):
        first_batch(DataSource(name="j", path=str(tmp_path / "j")))
    with pytest.raises(DataError, match="data source 'nope'"):
        first_batch(DataSource(name="nope", path=str(tmp_path / "missing")))
    (tmp_path / "e").mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e" / "empty.parquet")
    with pytest.raises(DataError, match="has no rows"):
        first_batch(DataSource(name="e", path=str(tmp_path / "e")))


@pytest.mark.slow
def test_bench_loader_prints_shares_and_throughput():
    # HF_HUB_OFFLINE=1 with local folders in the hub's layout: nothing may try the network.
    out = subprocess.run([sys.executable, "bench.py", "loader", "--config", "configs/debug_model.toml", "--tokens", "200000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "share" in out.stdout and "tokens/s" in out.stdout and "finemath" in out.stdout


@pytest.mark.slow
def test_bench_loader_reads_train_pys_config_and_its_overrides(monkeypatch, capsys):
    """`bench.py loader` reads train.py's config (pretrain/config.py's parser) and takes --section.key overrides.
    In this process: a launch would spend 4 s importing torch; the test above launches it whole."""
    import bench
    monkeypatch.chdir(ROOT)
    bench.main(["loader", "--config", "configs/debug_model.toml", "--show", "1", "--training.seq_len=64"])
    out = capsys.readouterr()
    assert out.out.startswith("--- sample 0 (64 tokens) ---\n<|begin_of_text|>"), out.err


class FlakyFiles:
    """An fsspec filesystem over local files whose reads fail now and then, like a hub connection."""
    fail_at: dict = {}  # path -> the read calls (counted per open) that raise, or "down": every read

    @classmethod
    def register(cls):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        class Flaky(LocalFileSystem):
            protocol = "flaky"

            def _open(self, path, mode="rb", **kwargs):
                f = super()._open(path.replace("flaky://", ""), mode, **kwargs)
                plan, calls, read = cls.fail_at.setdefault(path.replace("flaky://", ""), []), [0], f.read

                def flaky_read(*args):
                    calls[0] += 1
                    if plan == "down" or (plan and calls[0] == plan[0]):
                        if plan != "down":
                            plan.pop(0)
                        raise ConnectionResetError("connection reset by peer")
                    return read(*args)
                f.read = flaky_read
                return f

        fsspec.register_implementation("flaky", Flaky, clobber=True)


def test_transient_read_errors_are_retried_from_the_last_good_row(tok, sources, monkeypatch):
    import data
    monkeypatch.setattr(S, "RETRY_DELAYS", (0, 0, 0))
    FlakyFiles.register()

    pinned = data_manifest.source_files
    files = [f for s in sources for f, _ in pinned(data_manifest.make_manifest([s]), s)]

    def loader(flaky):  # the files resolved as usual, then read through the flaky filesystem
        monkeypatch.setattr(data, "source_files", lambda *a: [(("flaky://" if flaky else "") + f, n) for f, n in pinned(*a)])
        return DataLoader(sources, tok, 256, 4, 0, 1, num_streams=1)

    reference = loader(False)
    expected = [next(reference)[0] for _ in range(200)]
    FlakyFiles.fail_at.clear()
    FlakyFiles.fail_at.update({f: [2, 4] for f in files})  # every file fails twice mid-way
    flaky = loader(True)
    assert all(torch.equal(next(flaky)[0], x) for x in expected)
    assert sum(2 - len(plan) for plan in FlakyFiles.fail_at.values()) >= 4  # errors did happen (json and parquet)

    FlakyFiles.fail_at.update({f: "down" for f in files})  # a connection that never comes back
    with pytest.raises(DataError, match=r"reading flaky://.* failed 4 times \(ConnectionResetError"):
        for _ in range(50):
            next(loader(True))


def test_the_loader_reads_with_metas_tokenizer(sources):
    """Meta's Llama 3 tokenizer.model (llama-models, requirements-dev.txt), the 8B configs' vocabulary: its ids
    pass the loader as they are, above 2^16 included, with BOS at each document start."""
    llama_models = pytest.importorskip("llama_models")
    meta = Tokenizer(os.path.join(os.path.dirname(llama_models.__file__), "llama3", "tokenizer.model"))
    assert (meta.n_words, meta.bos_id, meta.eos_id) == (128256, 128000, 128001)
    inputs, labels = next(DataLoader(sources, meta, 256, 4, 0, 1, num_streams=1, seed=3))
    assert inputs.dtype == torch.long and inputs.shape == (4, 256)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert (inputs == meta.bos_id).any() and inputs.max() > 65535 and inputs.max() < meta.n_words


@pytest.mark.parametrize("workers, resume_workers", [(1, 2), pytest.param(2, 0, marks=pytest.mark.slow)])
def test_loader_workers_give_the_same_stream_and_resume_exactly(tok, sources, workers, resume_workers):
    def make(w):
        return DataLoader(sources, tok, 256, 4, 0, 1, num_streams=2, seed=3, num_workers=w)

    reference = make(0)
    expected = [next(reference)[0] for _ in range(300)]
    loader = make(workers)
    got = [next(loader)[0] for _ in range(120)]  # the workers have read well ahead by now
    state = {s: json.loads(json.dumps(sd)) for s, sd in loader.state_dict().items()}
    loader.close()
    loader = make(resume_workers)  # another worker count: the stream does not depend on it
    loader.load_state_dict(state)
    got += [next(loader)[0] for _ in range(180)]
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.slow
def test_bench_loader_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    # One launch: the whole program's stderr is the one line (no traceback, no import-time noise).
    launch = [sys.executable, "bench.py", "loader", "--config", "configs/debug_model.toml",
              "--model.tokenizer_path", "missing.model"]
    out = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: tokenizer file 'missing.model' not found; download it with download_tokenizer.py or set "
        "--model.tokenizer_path"]
    # The other bad inputs in this process, through the same main() and its one-line exit (a launch each would
    # spend 4 s importing torch).
    import bench
    monkeypatch.chdir(ROOT)

    def cli(*args):
        capsys.readouterr()  # what came before
        with pytest.raises(SystemExit) as e:
            bench.main(["loader", *args])
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    bad = tmp_path / "bad.toml"
    debug = open(os.path.join(ROOT, "configs", "debug_model.toml")).read()
    bad.write_text(debug.replace("weight = 0.2", "wieght = 0.2"))
    code, _, err = cli("--config", str(bad))
    assert code == 2 and err.strip().splitlines() == [
        f"error: {bad}: unknown key 'wieght' in [[data.sources]] 3; did you mean weight?"]
    for args, message in [(["--config", "configs/debug_model.toml", "--training.seq_len", "x"], "expected int"),
                          (["--config", "a.toml", "--config", "b.toml"], "give one file"),
                          (["--config", "configs/debug_model.toml", "--data.num_workers", "-1"],
                           "data.num_workers = -1")]:
        code, _, err = cli(*args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    # --help documents the options the README and bench.py use
    code, out, _ = cli("--help")
    assert code == 0
    for option in ("--config", "--show", "--tokens", "--model.tokenizer_path", "--training.seq_len",
                   "--training.local_batch_size", "--data.num_workers", "--data.seed"):
        assert option in out


def corrupt(path, at: int, n: int = 64):
    """Overwrite n bytes at offset `at` with garbage: content damage no retry can mend."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(range(7, 7 + n)))


@pytest.fixture
def damaged(tmp_path):
    """A parquet file whose third row group (rows 8-11) is damaged, and a gzip json file damaged mid-way."""
    rng = random.Random(0)  # fixed content: the damage does the same thing on every run
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"text": [f"parquet document {i} " + rng.randbytes(200).hex() for i in range(16)]}),
                   tmp_path / "p" / "x.parquet", row_group_size=4, compression="zstd", use_dictionary=False)
    chunk = pq.ParquetFile(tmp_path / "p" / "x.parquet").metadata.row_group(2).column(0)
    corrupt(tmp_path / "p" / "x.parquet", chunk.data_page_offset + chunk.total_compressed_size // 2)
    (tmp_path / "j").mkdir()
    # Random content would sometimes decode past the damage to garbage that only the CRC at the end of the
    # file catches (about 1 run in 40): the test reads the whole file either way.
    lines = "".join(json.dumps({"text": f"json document {i} " + rng.randbytes(300).hex()}) + "\n" for i in range(200))
    (tmp_path / "j" / "a.json.gz").write_bytes(gzip.compress(lines.encode()))
    corrupt(tmp_path / "j" / "a.json.gz", (tmp_path / "j" / "a.json.gz").stat().st_size // 2)
    return tmp_path


@pytest.mark.parametrize("folder, where, workers", [("p", r"x.parquet at row 8 ", 0), ("j", r"a.json.gz at row \d+ ", 0),
                                                     ("p", r"x.parquet at row 8 ", 1)])
def test_corrupt_content_is_one_line_at_once_not_retried(tok, damaged, monkeypatch, folder, where, workers):
    def no_retry(seconds):
        raise AssertionError(f"corrupt content was retried (a {seconds} s pause)")
    monkeypatch.setattr(time, "sleep", no_retry)
    loader = DataLoader([DataSource(name="bad", path=str(damaged / folder))], tok, 32, 1, 0, 1, num_streams=1, num_workers=workers)
    loader.check()  # the first rows are fine
    try:
        with pytest.raises(DataError, match=f"data source 'bad': reading .*{where}failed at once: the file is damaged") as e:
            for _ in range(20000):  # the file holds about 3,000 batches: the damage or the CRC at its end is reached
                next(loader)
        assert "\n" not in str(e.value)
        # The next batch (the trainer reads on to the end of its accumulation) fails the same way, at once: not
        # with the StopIteration of a finished generator, nor a worker found dead seconds later.
        with pytest.raises(DataError) as again:
            next(loader)
        assert str(again.value) == str(e.value)
    finally:
        loader.close()


def test_check_resolves_and_opens_every_source_before_the_first_batch(tok, sources, tmp_path, damaged):
    checked, plain = DataLoader(sources, tok, 64, 2, 0, 1, num_streams=2), DataLoader(sources, tok, 64, 2, 0, 1, num_streams=2)
    checked.check()  # reads ahead in a copy: the stream is unchanged
    assert all(torch.equal(next(checked)[0], next(plain)[0]) for _ in range(5))
    missing = DataSource(name="gone", path=str(tmp_path / "missing"))
    with pytest.raises(DataError, match=r"^data source 'gone': no 'train' files for path="):
        DataLoader(sources + [missing], tok, 64, 2, 0, 1, num_streams=2).check()
    pq.write_table(pa.table({"text": ["a b c"] * 4}), damaged / "q.parquet")
    corrupt(damaged / "q.parquet", 4, 200)  # the first row group: unreadable from the start
    with pytest.raises(DataError, match=r"^data source 'q': reading .*q.parquet at row 0 failed"):
        DataLoader([DataSource(name="q", path=str(damaged), data_files="q.parquet")], tok, 64, 2, 0, 1, num_streams=2).check()


def test_heldout_windows_read_one_source_once_in_file_order(tok, tmp_path):
    (tmp_path / "v").mkdir()
    docs = {name: [f"{name} held-out document {i} " * (3 + i) for i in range(6)] for name in ("b", "a")}
    for name, texts in docs.items():
        with open(tmp_path / "v" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    src = DataSource(name="v", path=str(tmp_path / "v"))
    tokens = [t for name in ("a", "b") for text in docs[name] for t in tok.encode(text)]  # sorted files, BOS/EOS
    windows = heldout_windows(src, tok, 15)
    assert windows == [tokens[i:i + 16] for i in range(0, len(tokens) - 15, 16)]  # every complete window, once
    assert heldout_windows(src, tok, 15, limit=3) == windows[:3] and heldout_windows(src, tok, 15) == windows
    with pytest.raises(DataError, match=r"validation source 'v' has no complete sequence of seq_len\+1"):
        heldout_windows(src, tok, len(tokens), None)
    with pytest.raises(DataError, match="data source 'w'"):
        heldout_windows(DataSource(name="w", path=str(tmp_path / "missing")), tok, 15)
    # the bundled held-out slices, one per source of the debug config, outside its training globs
    for name, path, files in HELDOUT:
        assert len(heldout_windows(DataSource(name=name, path=os.path.join(ROOT, path), data_files=files), tok, 256)) >= 20


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_loader_workers_ignore_stop_signals_and_die_with_their_parent(tok, sources):
    reference = DataLoader(sources, tok, 1024, 2, 0, 1, num_streams=1)
    loader = DataLoader(sources, tok, 1024, 2, 0, 1, num_streams=1, num_workers=2)
    loader.workers = data.Workers(loader.streams, 2, loader.step)  # started here: the first signals reach them mid start-up
    for step in range(120):  # well past the 64 documents each queue reads ahead
        if step < 40:
            for p in loader.workers.procs:
                for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                    os.kill(p.pid, sig)
        assert torch.equal(next(loader)[0], next(reference)[0])
    procs = loader.workers.procs
    loader.close()
    assert [p.exitcode for p in procs] == [0, 0]  # they ended when told, not by a signal
    # a parent killed with SIGKILL cannot tell its workers: they notice and exit by themselves
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys
import time
import tomllib
sys.path.insert(0, {ROOT!r})
import data
import train
srcs = train.load_config(["--config", "configs/debug_model.toml"]).data.sources
loader = data.DataLoader(srcs, data.Tokenizer({TOKENIZER!r}), 64, 2, 0, 1, num_streams=1, num_workers=1)
next(loader)
print(*[p.pid for p in loader.workers.procs], flush=True)
time.sleep(120)
"""], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # (its semaphore-leak warning)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 1 and all(alive(p) for p in pids)
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "loader workers outlived their killed parent"


def big_documents(folder, n=4):
    """A json lines source of n documents of about 40,000 tokens: each one's message (103 KB) is larger than a pipe
    (64 KiB), so a worker that waits to write one has always written part of it."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(folder / "docs.jsonl", "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(10**6)}" for _ in range(8000))}) + "\n")
    return DataSource(name="big", path=str(folder), data_files="*.jsonl")


def test_a_loader_worker_killed_mid_document_is_one_fault_line_not_a_hang(tok, tmp_path):
    """SIGKILL to a worker (the out-of-memory killer's) that was writing a document into its queue leaves half of it
    in the pipe. The trainer reads what came whole, then gets one line that is a fault (exit 4: a restart without
    the node), and close() returns. Reading the half document waited forever for the rest."""
    loader = DataLoader([big_documents(tmp_path)], tok, 64, 2, 0, 1, num_streams=1)
    loader.workers = data.Workers(loader.streams, 1, loader.step, prefetch=2)
    next(loader)  # the first document came whole
    its_queue = loader.workers.queues[(0, 0)]
    deadline = time.time() + 30
    while not its_queue.full() and time.time() < deadline:  # the worker reads the next two documents
        time.sleep(0.01)
    time.sleep(0.5)  # its queue's thread writes the first of them into the pipe, and waits with it half written
    (worker,) = loader.workers.procs
    os.kill(worker.pid, signal.SIGKILL)
    outcome = []  # the error, then "closed": in a thread, as a read that waits forever cannot be interrupted

    def read_to_the_end():
        try:
            for _ in range(1000):  # the first document holds about 300 batches
                next(loader)
        except DataError as e:
            outcome.append(e)
        loader.close()
        outcome.append("closed")

    reader = threading.Thread(target=read_to_the_end, daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert outcome[-1:] == ["closed"], "a read of the dead worker's queue, or close(), is waiting forever"
    error = outcome[0]
    assert isinstance(error, DataError) and error.fault is True
    assert str(error) == f"data loader worker {worker.pid} died (killed by SIGKILL: out of memory?)"


def test_a_worker_stopped_by_a_data_error_hands_its_line_over_behind_a_full_pipe(tok, tmp_path):
    """The worker meets a bad line 64 documents ahead of the trainer, more than its pipe holds: its error waits in
    the queue's thread behind them. The worker stays until told to stop, so the trainer gets the source's line
    (exit 2: a person fixes the file), not that its worker died (exit 4: a restart that fails the same way)."""
    rng = random.Random(0)
    with open(tmp_path / "a.jsonl", "w") as f:
        for _ in range(150):  # 2.6 KB a message, under a pipe's atomic write: never half of one in the pipe
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(10**6)}" for _ in range(200))}) + "\n")
        f.write("{not json\n")
    source = DataSource(name="bad", path=str(tmp_path), data_files="*.jsonl")
    loader = DataLoader([source], tok, 64, 1, 0, 1, num_streams=1, num_workers=1)
    try:
        with pytest.raises(DataError, match=r"^data source 'bad': reading .*a.jsonl at row 150 failed at once"):
            for _ in range(100000):
                next(loader)
    finally:
        loader.close()


def test_local_folders_resolve_as_datasets_does(tmp_path, monkeypatch):
    """sources.local_files answers plain local globs without importing `datasets` (0.7 s of every start): the same
    files as datasets' own resolution for each pattern, or [] where it leaves the answer to datasets."""
    import datasets
    from datasets import load_dataset_builder
    for name in ["a.json.gz", "b.jsonl", "sub/c.json", "sub/deep/d.json", ".hid.json", ".hdir/e.json", "__sp/f.json",
                 "sub/config.json", "p/x.parquet", "p/y.parquet", "p/notes.txt", "mixed/m.json", "mixed/n.parquet",
                 "sub/dataset_info.json"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "link.json").symlink_to(tmp_path / "b.jsonl")
    answered = 0
    for pattern in ["*.json*", "**", "**/*.json", "sub/**", "sub/*", ".*", ".hdir/*", "__sp/*", "__*/*", "*/config.json",
                    "p/*.parquet", "p/*", "mixed/*", "**/*.parquet", "nothing/*", "*.gz", "s?b/[cd].json", "**/.*", "**.json"]:
        ours = S.local_files(str(tmp_path), pattern)
        try:
            theirs = sorted(load_dataset_builder(str(tmp_path), data_files=pattern).config.data_files["train"])
        except (FileNotFoundError, ValueError):
            theirs = []
        assert ours in (theirs, []), pattern
        answered += bool(ours)
    assert answered >= 8  # the plain cases
    (tmp_path / "node").mkdir()  # a folder reached through a symlink keeps the name it was given
    (tmp_path / "node" / "data").symlink_to(tmp_path / "p")
    assert S.local_files(str(tmp_path / "node" / "data"), "*.parquet") == sorted(
        load_dataset_builder(str(tmp_path / "node" / "data"), data_files="*.parquet").config.data_files["train"])
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda *a, **k: pytest.fail("datasets resolved a local glob"))
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml")])
    assert len(data_manifest.make_manifest(cfg.data.sources, cfg.validation.sources)["validation"]) == 4
