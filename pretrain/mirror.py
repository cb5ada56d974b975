"""A local mirror of pinned Hub files, DIR/<repo id>@<commit>/<path>, read instead of the Hub
([data] mirror), and where each file of the data manifest is read from:

    open_file    one file of the manifest: the mirror's checked copy, else the Hub (HubFile) or a
                 local path
    mirrored     the mirror's copy of a pinned file, checked against the record the download wrote
    fetch_file   one pinned file into the mirror (download_data.py), resumed where a killed
                 download stopped
"""

import contextlib
import hashlib
import json
import math
import os
import re
import time

import fsspec

from pretrain.data_manifest import ends_sha256, write_manifest
from pretrain.sources import HF_URL, HUB_TIMEOUT, MIB, NO_STEP, RETRY_DELAYS, DataError, HubFile
from pretrain.sources import bound_hub_requests, retry_or_raise


def open_file(path: str, size: int, timeout: float = HUB_TIMEOUT, budget: float = math.inf,
              name: str = "", step=NO_STEP):
    """A file of the manifest, for reading: a hub one at its commit (`timeout`: seconds without a
    byte before a read is retried; `budget`: for how long; `name`: the source, for its line; `step`:
    the training step's deadline), from the mirror when it holds it ("MIRROR::hf://..."), anything
    else through fsspec."""
    mirror, _, url = path.rpartition("::")
    if mirror and url.startswith("hf://"):
        local = mirrored(mirror, url, size)
        if local:
            return open(local, "rb")
        # HF_HUB_OFFLINE is read the way huggingface_hub reads it.
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        if offline:
            place = mirror_paths(mirror, url)[0]
            raise DataError(f"{place} is not in the data mirror (HF_HUB_OFFLINE=1): fetch it "
                            f"with python download_data.py --config C --world_size N --to {mirror}")
        path = url  # a file not in the mirror is read from the Hub
    if path.startswith("hf://"):
        return HubFile(path, size, timeout, budget, name, step)
    fs, fs_path = fsspec.core.url_to_fs(path)
    return fs.open(fs_path, "rb", cache_type="none")


def mirror_paths(mirror: str, url: str) -> tuple:
    """A pinned Hub file's place in a mirror, and the record of download_data.py's checks (outside
    the repos' tree). Both name the commit, and so does the download's <place>.part: a download
    killed at one commit never resumes into another's bytes, and two commits of a file (two runs'
    manifests) sit side by side."""
    repo, commit, name = re.fullmatch(HF_URL, url).groups()
    at = f"{repo}@{commit}"  # as in the hf:// URL
    return os.path.join(mirror, at, name), os.path.join(mirror, ".verified", at, name + ".json")


def mirrored(mirror: str, url: str, size: int) -> str:
    """The mirror's copy of a pinned Hub file, or '' if it holds none at its commit. The download
    checked all of it (the Hub's sha256); each open checks its size and ends_sha256 against that
    record (all bytes would read whole shards at each start on 2,048 ranks): a truncated or damaged
    copy is one line, never another stream."""
    local, record = mirror_paths(mirror, url)
    if not os.path.exists(record) or not os.path.exists(local):
        return ""
    with open(record) as f:
        done = json.load(f)  # written whole or not at all (write_manifest)
    if done["commit"] != re.fullmatch(HF_URL, url)[2]:
        return ""  # a record of another commit (moved by hand): never read another commit's bytes
    now = os.path.getsize(local)
    if now != size or done["size"] != size or ends_sha256(local, size) != done["ends"]:
        if now != size:
            what = f"is {now:,} bytes, not {size:,} (size check)"
        else:
            what = "is damaged (sha256 check)"
        raise DataError(f"data mirror file {local} {what}: "
                        "delete it and run download_data.py again")
    return local


def fetch_file(mirror: str, url: str, size: int, timeout: float, budget: float = math.inf,
               progress=lambda n: None) -> int:
    """One pinned Hub file into the mirror, unless there: into <place>.part (a killed download goes
    on, at the same commit: mirror_paths) by training's ranged reads and retries, checked (size; an
    LFS file's sha256), renamed and recorded. Returns the bytes fetched.
    (hf_hub_download(local_dir=...) resumes, and records a file's commit, but keeps one commit of a
    path, and its retries wait as long as a 429 says, past the budget.)"""
    bound_hub_requests(timeout)  # it bounds the listing below
    with contextlib.suppress(DataError):  # a damaged copy is fetched again
        if mirrored(mirror, url, size):
            return 0
    local, record = mirror_paths(mirror, url)
    part = local + ".part"  # the download so far
    fetched = 0  # bytes this call downloads (a resumed .part counts only its new bytes)
    started = time.monotonic()  # the retry budget runs from here
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        # The file is about to change: no record vouches for it (write_manifest makes its folder).
        os.remove(record)
    for failures in range(len(RETRY_DELAYS) + 1):
        on_disk = os.path.getsize(part) if os.path.exists(part) else 0
        have = min(on_disk, size)  # resume from what an earlier try or a killed download left
        try:
            lfs = fsspec.filesystem("hf").info(url).get("lfs")
            sha256 = getattr(lfs, "sha256", None)  # None if the file is not in LFS
            remote = HubFile(url, size, timeout, budget, url)
            with remote as f, open(part, "r+b" if have else "wb") as out:
                out.seek(have)
                f.seek(have)
                while chunk := f.read(8 * MIB):
                    fetched += out.write(chunk)
                    progress(len(chunk))
            break
        except Exception as e:
            retry_or_raise(url, url, f"downloading {local}", e, failures, started=started, budget=budget,
                           next_try=timeout)
    with open(part, "rb") as f:
        h = hashlib.file_digest(f, "sha256")
    if os.path.getsize(part) != size or sha256 not in (None, h.hexdigest()):
        os.remove(part)
        raise DataError(f"downloaded {url} is not the Hub's {size:,} bytes with sha256 {sha256}; "
                        "run it again")
    os.replace(part, local)
    commit = re.fullmatch(HF_URL, url)[2]
    checks = {"commit": commit, "size": size, "sha256": h.hexdigest(),
              "ends": ends_sha256(local, size)}
    write_manifest(checks, record)
    return fetched

