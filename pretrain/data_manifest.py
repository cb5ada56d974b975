"""The data manifest: each source's files, resolved once per run (sources.resolve_files), pinned
in <dump_folder>/data_manifest.json, handed to every rank through the job's store and read by every
rank and loader worker. A resume never resolves again; a local file that changed since is one line.

    make_manifest     resolve sources into a manifest (a Hub source: its commit, files with sizes)
    pinned_manifest   the run's manifest: [data] manifest, or made once at the first start
    shared_manifest   rank 0's manifest to every rank, through the c10d store, within a deadline
    verify_manifest   local files still the bytes the manifest recorded
    source_files      a source's files as (URL at the commit, or path; size), for the readers
"""

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import socket
import time
import zlib
from datetime import timedelta

import fsspec

from pretrain.sources import HF_URL, HUB_TIMEOUT, MIB, RETRY_DELAYS, DataError, DataSource, resolve_files
from pretrain.sources import retry_or_raise

logger = logging.getLogger("data")  # sources.py's logger, so the data's lines read "data"

MANIFEST = "data_manifest.json"  # kept in the dump folder, unless [data] manifest names one
KEY = ("name", "path", "config", "data_files", "split", "revision")  # what decides a source's files


def ends_sha256(path: str, size: int) -> str:
    """sha256 of a local file's first and last MiB (all of it when small): a cheap "same bytes?"
    that, unlike the modification time, copies do not reset and `rsync -a` does not keep for other
    bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(MIB))
        f.seek(max(MIB, size - MIB))
        h.update(f.read())
    return h.hexdigest()


def resolve_source(src: DataSource, timeout: float = HUB_TIMEOUT,
                   budget: float = math.inf) -> dict:
    """One manifest entry: the source's key, the commit a hub revision points at (None for a local
    folder) and its sorted files as [name in the repo or folder, size] (+ the ends' sha256 for a
    local file)."""
    urls = resolve_files(src.path, src.config, src.data_files, src.split, src.revision, name=src.name,
                         timeout=timeout, budget=budget)
    entry = {k: getattr(src, k) for k in KEY}
    hub = [re.fullmatch(HF_URL, u) for u in urls]
    if all(hub):  # `datasets`' listing filled HfFileSystem's cache: the sizes cost no request
        fs = fsspec.filesystem("hf")
        started = time.monotonic()
        for failures in range(len(RETRY_DELAYS) + 1):  # it retries only if the cache was cleared
            tried = time.monotonic()
            try:
                files = [[m[3], fs.info(u)["size"]] for m, u in zip(hub, urls)]
                return {**entry, "commit": hub[0][2], "files": files}
            except Exception as e:
                waited = max(timeout, time.monotonic() - tried)
                retry_or_raise(src.name, src.path, "reading the sizes of its files", e, failures,
                               started=started, budget=budget, next_try=waited)
    root = os.path.abspath(src.path)
    sizes = map(os.path.getsize, urls)
    files = [[os.path.relpath(u, root), n, ends_sha256(u, n)] for u, n in zip(urls, sizes)]
    return {**entry, "commit": None, "files": files}


def make_manifest(sources, validation=(), timeout: float = HUB_TIMEOUT,
                  budget: float = math.inf) -> dict:
    data = [resolve_source(s, timeout, budget) for s in sources]
    held_out = [resolve_source(s, timeout, budget) for s in validation]
    return {"version": 1, "data": data, "validation": held_out}


def manifest_sha256(manifest: dict, sources=None) -> str:
    """A resume key: the sha256 of the canonical JSON of the manifest's training sources (`sources`'
    in order if given: a source a refused resume pinned changes nothing; validation ones never)."""
    entries = manifest["data"] if sources is None else [manifest_entry(manifest, s, "data") for s in sources]
    data = {"version": manifest["version"], "data": entries}
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def source_sha256s(manifest: dict, sources) -> list:
    """Each training source's pinned files, as a resume key that may grow: the sha256 of the
    canonical JSON of its manifest entry, in [[data.sources]] order. A resume may append a source
    (a later phase's), never change one."""
    entries = [json.dumps(manifest_entry(manifest, s, "data"), sort_keys=True, separators=(",", ":"))
               for s in sources]
    return [hashlib.sha256(e.encode()).hexdigest() for e in entries]


def write_manifest(manifest: dict, path: str):
    """Atomically: a crash leaves the old file or the new one. The temporary file is this process's
    own."""
    text = json.dumps(manifest, indent=1)
    flat_list = r"\[\n\s*([^\[\]{}]*?)\n\s*\]"  # a list holding no list or object
    # each file takes one line; JSON strings never hold a raw newline
    text = re.sub(flat_list, lambda m: "[" + re.sub(r",\n\s*", ", ", m[1]) + "]", text)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk or a read-only or missing folder is the user's to fix
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise DataError(f"cannot write the data manifest {path}: {e.strerror or e}; free space "
                        "there or choose another job.dump_folder (or --manifest PATH)") from e


def is_entry_of(e: dict, src: DataSource) -> bool:
    """Whether the manifest entry `e` was resolved for the configured source `src`."""
    return all(e[k] == getattr(src, k) for k in KEY)


def manifest_entry(manifest: dict, src: DataSource, section: str):
    """The manifest's entry for a configured source, or None."""
    return next((e for e in manifest[section] if is_entry_of(e, src)), None)


def source_files(manifest: dict, src: DataSource, section: str = "data") -> list:
    """The source's files from the manifest, as (hf:// URL at the pinned commit, or local path,
    size)."""
    e = manifest_entry(manifest, src, section)
    if e is None:
        raise DataError(f"the data manifest has no {section} source {src.name!r} as configured "
                        f"(path={src.path!r} config={src.config!r} data_files={src.data_files!r} "
                        f"split={src.split!r}): it was made for other sources; make a new one "
                        "(python download_data.py --config C --manifest PATH) for a new run")
    if not e["commit"]:  # a local folder
        return [(os.path.join(e["path"], name), size) for name, size, *_ in e["files"]]
    at = f"hf://datasets/{e['path']}@{e['commit']}/"
    if manifest.get("mirror"):  # the mirror is read first
        at = f"{os.path.abspath(manifest['mirror'])}::{at}"
    return [(at + name, size) for name, size, *_ in e["files"]]


def pinned_manifest(given: str, dump_folder: str, sources, validation,
                    timeout: float = HUB_TIMEOUT, budget: float = math.inf) -> dict:
    """The run's manifest: `given` ([data] manifest), else the dump folder's, made at the first
    start, on one rank. Local files new since then are counted (one line per source), never read.
    `timeout`, `budget`: as resolve_files."""
    path = given or os.path.join(dump_folder, MANIFEST)
    if not os.path.exists(path) and not given:
        write_manifest(make_manifest(sources, validation, timeout, budget), path)
        resolved = len(sources) + len(validation)
        logger.info(f"data manifest: resolved {resolved} sources once, pinned in {path}")
    try:
        with open(path) as f:
            manifest = json.load(f)
        # A run's manifest grows to hold a source of a new name, appended at a resume for a phase to
        # come; a manifest the user made must hold every source, and a source changed is refused.
        added = [s for s in sources if s.name not in {e["name"] for e in manifest["data"]} and not given]
        for s in sources:
            if s not in added:
                source_files(manifest, s, "data")
        new = [s for s in validation if manifest_entry(manifest, s, "validation") is None]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fix = ("make it with python download_data.py --config C --manifest PATH" if given else
               "delete it (the data is then resolved again: only with no checkpoint in the dump "
               "folder) or use a new dump_folder")
        why = str(e)[:300]
        raise DataError(f"data manifest {path} cannot be used: {why}; {fix}".replace("\n", " "))
    if added:
        manifest["data"] += [resolve_source(s, timeout, budget) for s in added]
        write_manifest(manifest, path)
        logger.info(f"data manifest: training source(s) {', '.join(s.name for s in added)} pinned now")
    if new:  # validation sources are pinned when first used: a resume may add one (or drop one)
        manifest["validation"] += [resolve_source(s, timeout, budget) for s in new]
        # A manifest the user made is theirs: the added sources are pinned for this start only.
        if not given:
            write_manifest(manifest, path)
        names = ", ".join(s.name for s in new)
        logger.info(f"data manifest: validation source(s) {names} pinned now")
    # only local folders are listed again: listing one costs no request
    for e in manifest["data"] + manifest["validation"]:
        if e["commit"] is None and os.path.isdir(e["path"]):
            log_new_files(e, path, timeout, budget)
    return manifest


def log_new_files(e: dict, path: str, timeout: float, budget: float):
    """One line if a local source's folder has files its manifest entry (from `path`) does not."""
    try:
        now = resolve_files(*(e[k] for k in KEY[1:]), e["name"], timeout, budget)
    except DataError:
        return  # if no files are left, verify_manifest names them
    root = os.path.abspath(e["path"])
    new = len({os.path.relpath(u, root) for u in now} - {f[0] for f in e["files"]})
    if new:
        logger.info(f"data source {e['name']!r}: {new} new file(s) in {e['path']} since {path} was "
                    "made are not read by this run; a new run (from the weights: "
                    "checkpoint.initial_load_path) would")


def shared_manifest(store, rank: int, wait: float, make):
    """Each rank's copy of the run's manifest (or rank 0's DataError, raised on each): rank 0 alone calls
    make(), puts it in the job's c10d store (not a gloo group: sockets to every rank); all wait
    `wait` s (a Hub may outlast a collective)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
    key = f"data_manifest_{restart}"  # a restarted job's store keeps old keys
    if rank == 0:
        try:
            result = make()
        except DataError as e:  # the one line every rank prints
            result = {"error": str(e), "fault": e.fault}
        # every rank GETs it, and paths compress ~10x
        store.set(key, zlib.compress(json.dumps(result).encode()))
    try:
        store.wait([key], timedelta(seconds=wait))
    except RuntimeError as e:  # c10d's DistStoreError
        fix = ("raise it, or make the manifest before the job (python download_data.py --config C "
               "--manifest PATH; [data] manifest = PATH)")
        raise DataError(f"rank {rank} waited data.resolve_timeout_seconds = {wait} s for rank 0 to "
                        f"resolve the data: {fix}", fault=True) from e
    result = json.loads(zlib.decompress(store.get(key)))
    if isinstance(result, dict) and "error" in result:  # every rank raises it: no need to agree
        raise DataError(result["error"], fault=result["fault"])
    return result


def verify_manifest(manifest: dict, part: int = 0, parts: int = 1, sources=None) -> str:
    """'' if every local file of the manifest's `sources` (None: all; this rank's share: every
    parts-th) has its size and ends_sha256, else one line naming the first that has not. Hub files
    are immutable at a commit."""
    entries = manifest["data"] + manifest["validation"]
    if sources is not None:  # a source the config dropped is not read, so not checked
        entries = [e for e in entries if any(is_entry_of(e, s) for s in sources)]
    local_entries = [e for e in entries if not e["commit"]]
    local = sorted({(e["name"], e["path"], *f) for e in local_entries for f in e["files"]})
    for name, root, rel, size, ends in local[part::parts]:
        path = os.path.join(root, rel)
        now = None  # the file's size, once it is known to exist
        try:
            now = os.path.getsize(path)
            same = now == size and ends_sha256(path, size) == ends
        except OSError:
            same = False
        if same:
            continue
        if now is None:
            what = "is missing"
        elif now == size:
            what = "changed (other bytes, same size)"
        else:
            what = f"changed (size {size:,} -> {now:,} bytes)"
        return (f"data source {name!r}: {path} {what} since this run's data manifest was made; a "
                "run reads only the data it started with: put the file back, or start a new run (a "
                "new dump_folder, from the weights with checkpoint.initial_load_path)")
    return ""
