"""The files a run reads, before the run: its pinned Hub files into a local mirror, or its data manifest alone.

    python download_data.py --config configs/llama3_8b.toml --world_size 2048 --to /lustre/mirror
    python download_data.py --config C --world_size N --to DIR --tokens 2_000_000_000  # first 2B
    python download_data.py --config C --manifest m.json  # resolve once, read no data
    python download_data.py --help  # every option

Train from the mirror with `--data.mirror DIR` ([data] mirror; HF_HUB_OFFLINE=1 where no Hub
answers), or with `--data.manifest m.json` to skip the resolution at the first start. Other
`--section.key value` arguments set train.py's config. docs/data.md#the-data-manifest says more.
"""

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import fsspec
import pyarrow.parquet as pq

import train
from data import SourceReader, Tokenizer
from pretrain import evals
from pretrain.config import ConfigError
from pretrain.data_manifest import make_manifest, manifest_sha256, pinned_manifest, source_files, write_manifest
from pretrain.mirror import fetch_file, mirror_paths
from pretrain.progress import Progress
from pretrain.sources import DataError

SAMPLE_TOKENS = 2_000_000  # tokens read from a source's first file to estimate its tokens per byte
MARGIN = 1.25  # files fetched for this much more than each stream's share: shares vary file to file


class Stopped(BaseException):
    """Ends a fetching thread at its next chunk. Not an Exception: fetch_file retries those."""


def world_size(cfg, given: int) -> int:
    """The run's GPUs: --world_size, or fixed degrees (data_parallel_shard_degree != -1). The batch
    and streams follow it where left to the layout (global_batch_size = -1, num_streams = 0)."""
    p = cfg.parallelism
    if given:
        return given
    if p.data_parallel_shard_degree != -1:
        return p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.tensor_parallel_degree
    if cfg.training.global_batch_size == -1 or cfg.data.num_streams == 0:
        raise ConfigError("--world_size is missing: this config's batch or data streams follow the "
                          "number of GPUs (global_batch_size = -1 or num_streams = 0); "
                          "give the real job's, e.g. --world_size 2048")
    return 1


def fetch(todo: list, to: str, workers: int, timeout: float, budget: float) -> int:
    """fetch_file for each (hf:// URL, size), `workers` at once, under a progress bar (bytes, files,
    rate, ETA). An error or Ctrl-C stops each fetch at its next chunk; a later run resumes it."""
    stop = threading.Event()
    total = sum(size for _, size in todo)
    with Progress(total, f"fetching into {to}", "B") as bar:
        def progress(n: int):
            if stop.is_set():
                raise Stopped
            bar.update(n)

        pool = ThreadPoolExecutor(workers)
        jobs = {pool.submit(fetch_file, to, url, size, timeout, budget=budget, progress=progress): size
                for url, size in todo}  # each fetch -> its file's size
        try:
            for done, job in enumerate(as_completed(jobs), 1):
                total -= jobs[job] - job.result()  # bytes there before: not in rate and ETA
                bar.update(0, total=total, note=f"{done}/{len(jobs)} files")
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)  # running fetches end at their next chunk
    return sum(job.result() for job in jobs)


def tokens_per_byte(path: str, size: int, src, tokenizer: Tokenizer) -> float:
    """Tokens per byte of `src`'s local file, from its first SAMPLE_TOKENS (a C4 shard holds ~150M):
    over the compressed bytes read so far for json lines, the rows' share of a parquet file."""
    tokens = 0
    if path.endswith(".parquet"):
        rows = pq.ParquetFile(path).metadata.num_rows
        read = 0  # rows read so far
        reader = SourceReader(src, [(path, size)], stream=0, num_streams=1, seed=0, ordered=True)  # one file
        for read, text in enumerate(reader.texts(one_pass=True), 1):
            tokens += len(tokenizer.encode(text))
            if tokens >= SAMPLE_TOKENS:
                break
        return tokens / (size * read / rows)
    compression = fsspec.utils.infer_compression(path)
    with open(path, "rb") as raw:  # its position: the compressed bytes the decompressor has read
        f = fsspec.compression.compr[compression](raw, mode="rb") if compression else raw
        for line in f:
            if line.strip():
                tokens += len(tokenizer.encode(json.loads(line).get(src.text_column) or ""))
            if tokens >= SAMPLE_TOKENS:
                break
        return tokens / raw.tell()


def plan_files(cfg, manifest: dict, held_out: list, tokens: int, shares: list, streams: int, to: str,
               workers: int) -> dict:
    """{(url, size): the earliest position a stream reads it at} for each source's share of `tokens`
    (its first file fetched on the way, for its tokens per byte), and every held-out and eval file."""
    timeout = cfg.data.hub_timeout_seconds
    budget = cfg.comm.init_timeout_seconds
    plan = {}
    for s in held_out:
        for url, size in source_files(manifest, s, "validation"):
            if url.startswith("hf://"):
                plan[(url, size)] = 0
    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    for s, share in zip(cfg.data.sources, shares):
        files = [tuple(f) for f in source_files(manifest, s) if f[0].startswith("hf://")]
        if not files:  # a local folder
            continue
        # too few files: every stream reads all of them, split by rows
        n_orders = 1 if len(files) < streams else streams
        orders = [SourceReader(s, files, k, streams, cfg.data.seed)._files() for k in range(n_orders)]
        url, size = orders[0][0]
        fetch([(url, size)], to, workers, timeout, budget)
        per_byte = tokens_per_byte(mirror_paths(to, url)[0], size, s, tokenizer)
        need = MARGIN * tokens * share / len(orders)  # tokens per stream
        for order in orders:  # a stream's files in reading order, until they cover its share
            have = 0.0  # tokens this stream's files hold so far
            for i, (url, size) in enumerate(order):
                if have >= need:
                    break
                plan[(url, size)] = min(plan.get((url, size), i), i)  # its earliest position
                have += size * per_byte
    return plan


def download(cfg, held_out: list, tokens: int, shares: list, streams: int, to: str, workers: int):
    """The run's pinned Hub files into `to` (DIR/<repo id>@<commit>/<path>): held-out, eval files,
    and those each stream reads first for its share of `tokens`, with a margin. Files there stay."""
    timeout = cfg.data.hub_timeout_seconds
    budget = cfg.comm.init_timeout_seconds
    manifest = pinned_manifest(cfg.data.manifest, cfg.job.dump_folder, cfg.data.sources, held_out,
                               timeout, budget)
    plan = plan_files(cfg, manifest, held_out, tokens=tokens, shares=shares, streams=streams, to=to, workers=workers)
    fetched = fetch(sorted(plan, key=plan.get), to, workers, timeout, budget)  # earliest read first
    total = sum(size for _, size in plan)
    print(f"{to}: {len(plan):,} files, {total:,} bytes ({fetched:,} fetched now) for {tokens:,} tokens; "
          f"run from it with --data.mirror {to} ([data] mirror), HF_HUB_OFFLINE=1 where no Hub is")


def manifest_only(sources: list, held_out: list, path: str, timeout: float, budget: float):
    """Write the sources' data manifest (Hub listings, local globs) to `path`: no data is read."""
    manifest = make_manifest(sources, held_out, timeout, budget)
    write_manifest(manifest, path)
    for e in manifest["data"] + manifest["validation"]:
        where = f"{e['path']}@{e['commit']}" if e["commit"] else e["path"]
        n_bytes = sum(f[1] for f in e["files"])
        print(f"{e['name']:>16}: {len(e['files']):>6,} files {n_bytes:>18,} bytes  {where}")
    print(f"wrote {path} (sha256 {manifest_sha256(manifest)}); use it with [data] manifest")


def main(argv: list):
    summary = __doc__.split("\n")[0]  # the docstring's first line
    p = argparse.ArgumentParser(prog="download_data.py", description=summary, allow_abbrev=False,
                                epilog="Every other --section.key value sets train.py's config as "
                                "for the run (python train.py --help lists them).")
    p.add_argument("--config", action="append", help="train.py's TOML config, e.g. configs/llama3_8b.toml")
    p.add_argument("--to", metavar="DIR", help="the mirror folder: DIR/<repo id>@<commit>/<path>, "
                   "for [data] mirror")
    p.add_argument("--tokens", type=int, help="training tokens to fetch the files for "
                   "(default: training.steps x global batch x seq_len, the whole run)")
    p.add_argument("--world_size", type=int, help="the run's GPUs: its batch and streams "
                   "(needed when the config leaves them to the layout)")
    p.add_argument("--workers", type=int, default=8, help="files fetched at once")
    p.add_argument("--manifest", metavar="PATH",
                   help="instead: resolve the training, validation and eval sources and write "
                   "their data manifest here (for [data] manifest), without reading any data")
    args, rest = p.parse_known_args(argv)
    cfg = train.load_config([x for c in args.config or [] for x in ("--config", c)] + rest)
    held_out = cfg.validation.sources + evals.sources(cfg.eval)  # [eval]'s tasks: read through it
    if args.manifest:
        return manifest_only(cfg.data.sources, held_out, args.manifest,
                             cfg.data.hub_timeout_seconds, cfg.comm.init_timeout_seconds)
    if not args.to:
        raise ConfigError("--to DIR is missing: the folder to fetch the run's files into "
                          "(or --manifest PATH)")
    sizes = train.validate(cfg, world_size(cfg, args.world_size), gpu=True)  # the job's GPUs' rules
    per_source = sizes["phases"].source_tokens(cfg.training.steps)  # by its weight in each of [[phases]]
    shares = [n / sum(per_source) for n in per_source]
    download(cfg, held_out, tokens=args.tokens or sizes["phases"].tokens_through(cfg.training.steps), shares=shares,
             streams=cfg.data.num_streams or sizes["dp"], to=args.to, workers=args.workers)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError) as e:  # the user's input, not a bug: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("stopped: files fetched so far are kept, and a .part goes on where it stopped", file=sys.stderr)
        sys.exit(130)
