"""Where the data is: each source's files (a Hub dataset at a commit, or a local folder), resolved
once per run into the data manifest, and read back byte for byte. data.py turns what is read here
into batches.

    DataSource        one [[data.sources]] / [[validation.sources]] table
    resolve_files     the source's files (a Hub id as `datasets` resolves it, or a local folder)
    retry_or_raise    the retry rule of every Hub read: transient errors, within a budget
    NO_STEP           the deadline of reads outside a training step: none (a loader owns its step's)
    HubFile           one pinned Hub file, read by ranged GETs that retry where they broke
Pinning what was resolved: data_manifest.py. Reading a pinned file (the Hub, a mirror, a path): mirror.py.
"""

import glob
import io
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import PurePath
from typing import Optional


# Retries after a transient error (connection, timeout, HTTP 408/429/5xx) pause for about 4 minutes
# in all, then stop, or stop sooner where the retry budget ends. Anything else (a corrupt file,
# 401/403/404) stops at once.
RETRY_DELAYS = (1, 2, 4, 8, 16, 32, 60, 60, 60)
TRANSIENT = ("ConnectionError", "TimeoutError", "TransportError", "Timeout", "TimeoutException",
             "NetworkError", "RemoteProtocolError", "ChunkedEncodingError", "IncompleteRead",
             "ClientConnectionError")
# datasets' metadata files (FILES_TO_IGNORE, the YAML that sets configs) are data only if a pattern
# names one.
METADATA_FILES = ("README.md", ".huggingface.yaml", "config.json", "dataset_info.json",
                  "dataset_infos.json", "dataset_dict.json", "dummy_data.zip")
HUB_TIMEOUT = 60.0  # seconds a Hub read may go without a byte ([data] hub_timeout_seconds)
HF_URL = r"hf://datasets/(.+?)@([0-9a-f]{40})/(.+)"  # a pinned Hub file: repo id, commit, path
logger = logging.getLogger("data")
# A read's `step` is [end, seconds] of its training step's reads; the end is a time.monotonic() (one clock
# for every process of a machine), inf while none reads. A DataLoader keeps its step in memory its
# loader workers share (DataLoader.reads_within); a read outside a training step has none.
NO_STEP = (math.inf, math.inf)


class DataError(ValueError):
    """A problem with the user's tokenizer, data or data config (not a bug): its text is one line,
    which train.py and the CLI print as is (exit 2). fault: the infrastructure's instead (a Hub
    that kept failing, a slow read past a wait): exit 4, a restart may succeed (pretrain/faults.py)."""

    def __init__(self, line: str, fault: bool = False):
        super().__init__(line)
        self.fault = fault


@dataclass
class DataSource:
    name: str = ""  # label used in logs and metrics.jsonl
    path: str = ""  # hub dataset id (allenai/c4) or a local folder with json/json.gz/jsonl/parquet
    config: Optional[str] = None  # hub config name (e.g. "en"), optional
    data_files: Optional[str] = None  # glob relative to path, optional
    split: str = "train"  # dataset split
    revision: Optional[str] = None  # pinned hub revision (commit sha or tag), optional
    text_column: str = "text"  # column holding the document text
    weight: float = 1.0  # share of tokens (normalised over all sources)

    def __post_init__(self):  # config.py turns this into one line naming the table
        if not self.name or not self.path or not self.weight >= 0:
            raise ValueError(f"needs a name, a path and a weight >= 0 (got name={self.name!r}, "
                             f"path={self.path!r}, weight={self.weight!r})")


def transient(e: BaseException) -> bool:
    """A network blip worth a retry: a connection or timeout error, or HTTP 408/429/5xx, anywhere in
    the chain of causes (the libraries wrap them). Corrupt content (a bad gzip) is an OSError too,
    but no retry mends it."""
    while e is not None:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None:
            return status in (408, 429) or status >= 500
        if any(c.__name__ in TRANSIENT for c in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
    return False


def asked_pause(e: BaseException) -> float:
    """Seconds the server asked for before the next try, anywhere in the chain of causes: a
    `Retry-After` in seconds (not an HTTP date, as in huggingface_hub), or the Hub's `RateLimit`
    reset when none are left; 0: none. huggingface_hub's http_backoff reads these too, but then
    sleeps as long as they say, whatever our budget."""
    while e is not None:
        headers = getattr(getattr(e, "response", None), "headers", None)
        if headers is not None:
            from huggingface_hub.utils import parse_ratelimit_headers
            limit = parse_ratelimit_headers(headers)
            if limit is not None and limit.remaining == 0:
                return float(limit.reset_in_seconds)
            value = headers.get("Retry-After", "").strip()
            return float(value) if value.isdigit() else 0.0
        e = e.__cause__ or e.__context__
    return 0.0


def retry_or_raise(name: str, path: str, what: str, e: Exception, failures: int, *,
                   started: float = 0.0, budget: float = math.inf, next_try: float = 0.0,
                   step=NO_STEP):
    """Pause before retrying a transient error; anything else, or one failure too many, is one
    DataError line. So is a retry (its pause, then `next_try`: the longest the next try may take)
    that could end more than `budget` s (comm.init_timeout_seconds: the other ranks' wait in a
    collective) after `started`, when the first try failed, or past the end of the step's reads
    (`step`). The pause is at least what a 429 or 503 asks for (plus 1 s, as huggingface_hub
    waits), within that budget."""
    if isinstance(e, DataError):
        raise e
    spent = time.monotonic() - started
    retries_left = transient(e) and failures < len(RETRY_DELAYS)
    asked = asked_pause(e) if retries_left else 0.0  # never sooner than a rate-limiting Hub says
    pause = 0
    if retries_left:
        pause = max(RETRY_DELAYS[failures], asked + 1 if asked else 0)
    in_budget = spent + pause + next_try <= budget
    in_step = time.monotonic() + pause + next_try <= step[0]
    if retries_left and in_budget and in_step:
        logger.warning(f"data source {name!r}: {type(e).__name__} {what}; retrying in {pause:g} s")
        return time.sleep(pause)
    reason = f"{type(e).__name__}: {str(e)[:300]}"
    status = getattr(getattr(e, "response", None), "status_code", None)
    not_found = type(e).__name__ in ("DatasetNotFoundError", "RepositoryNotFoundError")
    asked_for = f" (the Hub asked for a pause of {asked:g} s)" if asked else ""
    times = "once" if not failures else f"{failures + 1} times"
    if status in (401, 403, 404) or not_found:
        http = f" (HTTP {status})" if status else ""
        why = (f"the Hub refused {path!r}{http} while {what}: check the dataset id and revision; "
               "for a gated or private set log in (`hf auth login` or `huggingface-cli login`, "
               "or set HF_TOKEN) and accept its terms on the dataset's Hub page")
    elif retries_left:  # but the next would pass its step's end (the sooner, if both) or this read's budget
        limit = budget if in_step else step[1]
        of_what = "" if in_step else " for the reads of one step in all"
        why = (f"{what} failed {times} in {spent:.0f} s and stopped retrying: another "
               f"try{asked_for} could end past comm.init_timeout_seconds = {limit:g} s{of_what}, how "
               "long the other ranks wait for this one in a collective; raise it to give the Hub longer")
    elif failures:
        why = f"{what} failed {failures + 1} times"
    else:
        why = f"{what} failed at once: the file is damaged or unreadable"
    # a transient error that outlasted its retries is the Hub's or the network's: a restart may work
    raise DataError(f"data source {name!r}: {why} ({reason})".replace("\n", " "),
                    fault=transient(e)) from e


def bound_hub_requests(timeout: float):
    """From here on in this process, a huggingface_hub request that names no timeout waits at most
    `timeout` seconds for a byte, then fails with a TimeoutException (retried). Such are `datasets`'
    listings (list_repo_tree passes timeout=None, "no timeout" to httpx, so a client timeout would
    not reach it): the client fills the bound in."""
    import httpx2
    from huggingface_hub import get_session, set_client_factory
    from huggingface_hub.utils._http import default_client_factory  # the library's own client

    def fill_in(request):
        if all(t is None for t in request.extensions.get("timeout", {}).values()):
            request.extensions["timeout"] = httpx2.Timeout(timeout).as_dict()

    def client():
        c = default_client_factory()
        c.event_hooks = {**c.event_hooks, "request": [*c.event_hooks["request"], fill_in]}
        # Read below: a new factory closes the open client, so set one only for a new bound.
        c.hub_timeout = timeout
        return c

    if getattr(get_session(), "hub_timeout", None) != timeout:
        set_client_factory(client)


def local_files(root: str, pattern: str) -> list:
    """A local folder's files that a data_files glob names (`*` within a name, `**` across folders),
    sorted, as `datasets` resolves them, without importing it (0.7 s of every start). [] where its
    rules say more (hidden or special names, a README's configs, `**` inside a name, mixed formats,
    no match): resolve_files asks it then."""
    # A symlinked folder stays as named, as datasets keeps it.
    root = os.path.abspath(os.path.expanduser(root))
    inside_name = re.search(r"[^/]\*\*|\*\*[^/]", pattern)  # `**` inside a name
    if inside_name or any(os.path.exists(os.path.join(root, f)) for f in METADATA_FILES):
        return []
    skipped = set(METADATA_FILES) - {os.path.basename(pattern)}  # one the pattern names is read
    matches = glob.glob(pattern, root_dir=root, recursive=True)
    files = sorted(f for f in matches
                   if os.path.isfile(os.path.join(root, f)) and os.path.basename(f) not in skipped)
    plain = not any(p.startswith((".", "__")) for f in files for p in PurePath(f).parts)
    extensions = {re.sub(r"\.(gz|bz2|xz|zst|lz4)$", "", f).rpartition(".")[2] for f in files}
    formats = {ext.replace("jsonl", "json") for ext in extensions}
    if plain and formats in ({"parquet"}, {"json"}):
        return [os.path.join(root, f) for f in files]
    return []


def resolve_files(path: str, config: Optional[str], data_files: Optional[str], split: str,
                  revision: Optional[str], name: str = "", timeout: float = HUB_TIMEOUT,
                  budget: float = math.inf) -> tuple:
    """The source's files, sorted: `datasets` resolves a hub id (hf:// URLs at the revision's commit)
    and a local folder (local_files the plain cases); a Hub request waits `timeout` s, a listing
    retries within `budget` s."""
    if data_files and not config and split == "train" and os.path.isdir(path):
        files = local_files(path, data_files)
        if files:
            return tuple(files)
    from datasets import load_dataset_builder
    bound_hub_requests(timeout)
    source = f"path={path!r} config={config!r} data_files={data_files!r}"
    what = f"resolving the {split!r} files of {source}"
    started = time.monotonic()
    for failures in range(len(RETRY_DELAYS) + 1):
        tried = time.monotonic()
        try:
            builder = load_dataset_builder(path, name=config, data_files=data_files,
                                           revision=revision)
            return tuple(sorted(builder.config.data_files[split]))
        except Exception as e:  # missing files, folder or split mean bad paths, not the network
            users = isinstance(e, (FileNotFoundError, KeyError, ValueError)) and not transient(e)
            if users and type(e).__name__ != "DatasetNotFoundError":
                line = f"data source {name!r}: no {split!r} files for {source} ({type(e).__name__}: {e})"
                raise DataError(line.replace("\n", " "))
            # A listing's requests retry in huggingface_hub: the next try may take as long as this one.
            next_try = max(timeout, time.monotonic() - tried)
            retry_or_raise(name, path, what, e, failures, started=started, budget=budget, next_try=next_try)


MIB = 1 << 20


class HubFile(io.RawIOBase):
    """A hub file at its pinned commit, read by ranged GETs of its resolve URL (HfFileSystem would
    list its folder). A transient error is retried here, for the range where it broke, so the
    reader above (a gzip decompressor, a parquet page) keeps its place: one more range request, not
    a re-read from byte 0. (HfFileSystemFile's ranges are retried by http_backoff, which sleeps as
    long as a 429 says, past the budget the other ranks wait for.)"""

    def __init__(self, url: str, size: int, timeout: float, budget: float = math.inf,
                 name: str = "", step=NO_STEP):
        from huggingface_hub import hf_hub_url
        self.repo, commit, path = re.fullmatch(HF_URL, url).groups()
        self.url = hf_hub_url(self.repo, path, repo_type="dataset", revision=commit)
        self.hf_url = url  # the hf:// URL, for the lines that name the file
        self.size = size
        self.pos = 0  # where the next read starts
        self.timeout = timeout  # seconds a request may go without a byte
        self.budget = budget  # seconds a failing range is retried for (comm.init_timeout_seconds)
        self.name = name or url  # the data source, for the one line that ends the retries
        self.step = step  # [end, seconds] of the training step's reads (NO_STEP for none)

    def readable(self):  # this and seekable say yes; io's defaults say no
        return True

    seekable = readable

    def seek(self, offset: int, whence: int = 0):
        self.pos = (offset, self.pos + offset, self.size + offset)[whence]
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        started = time.monotonic()  # the retry budget runs from this range's first try
        for failures in range(len(RETRY_DELAYS) + 1):
            if time.monotonic() > self.step[0]:  # slow answers, each within its timeout, add up
                raise DataError(f"data source {self.name!r}: the reads of one step took longer than "
                                f"comm.init_timeout_seconds = {self.step[1]:g} s, how long the other ranks wait "
                                f"for this one in a collective, before reading {self.hf_url} at byte "
                                f"{self.pos:,}; raise it to give the Hub longer", fault=True)
            try:
                body = self.get(self.pos, self.pos + n - 1)
                break
            except Exception as e:
                if not transient(e):  # refusals, wrong bytes go up: the caller's line names the row
                    raise
                retry_or_raise(self.name, self.repo, f"reading {self.hf_url}", e, failures, started=started,
                               budget=self.budget, next_try=self.timeout, step=self.step)
        buf[:len(body)] = body
        self.pos += len(body)
        return len(body)

    def get(self, first: int, last: int) -> bytes:
        """One try for bytes first..last (or fewer, from `first` on)."""
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff
        # huggingface_hub's client waits forever by default: a connection that stops sending would
        # hang the rank. A timeout makes it a TimeoutException. This is one try: readinto retries,
        # with pauses the budget can see. Redirects (to the CDN) keep the Range header.
        headers = {**build_hf_headers(), "Range": f"bytes={first}-{last}"}
        r = http_backoff("GET", self.url, headers=headers, timeout=self.timeout, max_retries=0)
        hf_raise_for_status(r)
        body = r.content
        if r.status_code == 200 and len(body) == self.size:  # the server ignored Range and sent all
            return body[first:last + 1]
        ranged = r.status_code == 206 and r.headers.get("Content-Range", "").startswith(f"bytes {first}-")
        if not ranged or not 0 < len(body) <= last + 1 - first:
            content_range = r.headers.get("Content-Range")
            raise OSError(f"asked {self.url} for bytes {first}-{last} and got HTTP {r.status_code} with "
                          f"{len(body):,} bytes (Content-Range {content_range!r}), not those bytes")
        return body
