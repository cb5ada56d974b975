"""data.py: tokenizer, readers, token-weighted mixture, packing and exact resume (CPU, no network)."""

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from data import DataError, DataLoader, DataSource, Tokenizer  # noqa: E402

TOKENIZER = os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def sources():
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml")])
    for s in cfg.data.sources:
        s.path = os.path.join(ROOT, s.path)
    return cfg.data.sources


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
    loader = DataLoader(sources, tok, 64, 4, 0, 1, 1)
    inputs, labels = next(loader)
    assert inputs.shape == labels.shape == (4, 64)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are inputs shifted by one
    assert inputs[0, 0] == tok.bos_id  # the first window starts a document
    flat = torch.cat([inputs[:, :1], labels], 1).flatten().tolist()
    # every EOS that is not the last token is followed by the next document's BOS
    assert all(flat[i + 1] == tok.bos_id for i, t in enumerate(flat[:-1]) if t == tok.eos_id)


def test_mixture_token_shares_within_one_point(tok, sources):
    loader = DataLoader(sources, tok, 256, 4, 0, 1, 1)
    while sum(loader.source_tokens().values()) < 1_000_000:
        next(loader)
    counts = loader.source_tokens()
    total = sum(counts.values())
    weights = {s.name: s.weight / sum(x.weight for x in sources) for s in sources}
    for name, c in counts.items():
        assert abs(c / total - weights[name]) < 0.01, (name, c / total, weights[name])


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_resume_is_exact_at_any_point(tok, sources, streams):
    """Restarts at several points (inside documents, after sources wrapped to epoch 1, twice in a
    row) give the uninterrupted stream. 4 streams over 2 files per source exercises the row split."""
    def make():
        return DataLoader(sources, tok, 256, 4, 0, 1, streams, seed=5)

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
    both = DataLoader(sources, tok, 64, 8, 0, 1, 2)
    rank0, rank1 = (DataLoader(sources, tok, 64, 4, r, 2, 2) for r in (0, 1))
    for _ in range(20):
        x, _ = next(both)
        assert torch.equal(x, torch.cat([next(rank0)[0], next(rank1)[0]]))
    assert not torch.equal(next(rank0)[0], next(rank1)[0])


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
    loader = DataLoader(srcs, tok, 32, 1, 0, 1, 1)
    text = tok.decode(torch.cat([next(loader)[0][0] for _ in range(10)]).tolist())
    assert "json document 0" in text and "parquet document 0" in text

    def first_batch(src):
        next(DataLoader([src], tok, 32, 1, 0, 1, 1))

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


def test_data_cli_prints_shares_and_throughput():
    # HF_HUB_OFFLINE=1 with local folders in the hub's layout: nothing may try the network.
    out = subprocess.run([sys.executable, "data.py", "--config", "configs/debug_model.toml", "--tokens", "200000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "share" in out.stdout and "tokens/s" in out.stdout and "finemath" in out.stdout
    show = subprocess.run([sys.executable, "data.py", "--config", "configs/debug_model.toml", "--show", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert show.stdout.startswith("--- sample 0 (256 tokens) ---\n<|begin_of_text|>")


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
    monkeypatch.setattr(data, "RETRY_DELAYS", (0, 0, 0))
    FlakyFiles.register()

    resolve = data.resolve_files
    files = [f for s in sources for f in resolve(s.path, s.config, s.data_files, s.split, s.revision)]

    def loader(flaky):  # the files resolved as usual, then read through the flaky filesystem
        monkeypatch.setattr(data, "resolve_files", lambda *a: tuple(("flaky://" if flaky else "") + f for f in resolve(*a)))
        return DataLoader(sources, tok, 256, 4, 0, 1, 1)

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


@pytest.mark.parametrize("workers, resume_workers", [(1, 2), (2, 0)])
def test_loader_workers_give_the_same_stream_and_resume_exactly(tok, sources, workers, resume_workers):
    def make(w):
        return DataLoader(sources, tok, 256, 4, 0, 1, 2, seed=3, num_workers=w)

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


def test_data_cli_bad_input_is_one_line():
    out = subprocess.run([sys.executable, "data.py", "--config", "configs/debug_model.toml", "--model.tokenizer_path",
                          "missing.model"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: tokenizer file 'missing.model' not found; download it with download_tokenizer.py or set "
        "--model.tokenizer_path"]
