"""Whether each node reads what the run reads: the data check of `preflight.py check`.

Rank 0 reads the run's pinned manifest as the run reads it and resolves the sources it lacks, once
(rank0_manifest); every rank gets that through the job's store (share_sources); each node checks its
share of the local files and reads each source's first document or example as the run reads it,
from [data] mirror where that holds the file (read_share). A node without a route to the Hub says
so in seconds (hub_unreachable). A library: the program that prints the verdicts is preflight.py."""

import dataclasses
import os
import re
import time
import urllib.error
import urllib.request

import torch.distributed as dist

import data
from pretrain import data_manifest
from pretrain import evals
from pretrain import mirror
from pretrain import sources


def hub_unreachable() -> str:
    """Why this node cannot reach the Hub (HF_ENDPOINT), or "": one request, so that a node without
    a route out fails in seconds rather than after every library's retries for every hub source."""
    from huggingface_hub import constants
    try:
        urllib.request.urlopen(constants.ENDPOINT, timeout=15).close()
    except urllib.error.HTTPError:  # it answered
        pass
    except OSError as e:
        why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        return f"this node cannot reach the Hub at {constants.ENDPOINT} ({why})"
    return ""


def configured(training: list, held_out: list, eval_cfg) -> list:
    """[(manifest section, source, its name in the report)] in the config's order: the training
    sources ([[data.sources]]), the held-out ones ([[validation.sources]]), then [eval]'s tasks
    (pinned in the manifest's validation section)."""
    groups = (("data", "data source", training),
              ("validation", "validation source", held_out),
              ("validation", "eval task", evals.sources(eval_cfg)))
    return [(kind, s, f"{what} {s.name!r} ({s.path})")
            for kind, what, srcs in groups for s in srcs]


def hub_id(path: str) -> bool:
    """Hub ids look like org/name and are not local folders."""
    return not os.path.exists(path) and bool(re.fullmatch(r"[\w.-]+/[\w.-]+", path))


def rank0_manifest(data_cfg, dump_folder: str, listed: list) -> tuple:
    """Rank 0's (manifest, (level, text) for the report, {source: why rank 0 cannot resolve it},
    [sources resolved now]): the run's pinned manifest ([data] manifest, else the dump folder's once
    a run made it) read as the run reads it, and the sources it lacks resolved once, each on its
    own, as the first start would. `listed`: configured()'s. Writes nothing."""
    t0 = time.perf_counter()
    given = data_cfg.manifest
    folder = dump_folder
    path = given or os.path.join(folder, data_manifest.MANIFEST)
    manifest = {"version": 1, "data": [], "validation": []}  # none yet: every source is missing
    state = None  # the report's (level, text), once something decides it
    if given or os.path.exists(path):
        # no validation sources: those it lacks are resolved below (a start pins them, preflight
        # writes nothing)
        try:
            manifest = data_manifest.pinned_manifest(given, folder, data_cfg.sources, [])
        except sources.DataError as e:
            state = ("FAIL", f"{e}; the sources below were resolved afresh")
    missing = [(kind, s, name) for kind, s, name in listed
               if not data_manifest.manifest_entry(manifest, s, kind)]
    offline = hub_unreachable() if any(hub_id(s.path) for _, s, _ in missing) else ""
    errors = {}  # source name -> why rank 0 cannot resolve it
    for kind, src, name in missing:
        try:
            if offline and hub_id(src.path):
                raise sources.DataError(offline)
            manifest[kind].append(data_manifest.resolve_source(src))
        except sources.DataError as e:
            errors[name] = str(e)
    n = len(listed) - len(missing)
    none_yet = f"none pinned yet ({path} is made at the run's first start)"
    pinned = f"{n} source(s) pinned in {path}" if n else none_yet
    seconds = time.perf_counter() - t0
    once = f"rank 0 resolved {len(missing)} source(s) once, in {seconds:.1f} s"
    state = state or ("OK", f"{pinned}; {once}; every node checks its local files against that")
    return manifest, state, errors, [name for _, _, name in missing]


def share_sources(data_cfg, dump_folder: str, listed: list, rank: int) -> tuple:
    """rank0_manifest on every rank, through the job's store with a deadline of its own, as
    startup.share_manifest does (data_manifest.shared_manifest): resolving many sources on a
    rate-limited Hub may take longer than a collective. A DataError if the wait runs out."""
    store = dist.distributed_c10d._get_default_store()
    wait = data_cfg.resolve_timeout_seconds  # seconds every rank waits for rank 0
    return data_manifest.shared_manifest(store, rank, wait,
                                         lambda: rank0_manifest(data_cfg, dump_folder, listed))


def from_hub(path: str, size: int) -> bool:
    """Whether reading this file of the manifest asks the Hub: a pinned Hub file that the data
    mirror does not hold (mirror.open_file's rule; a damaged copy there is mirror.mirrored's one
    line)."""
    where, _, url = path.rpartition("::")
    if where and url.startswith("hf://"):
        return not mirror.mirrored(where, url, size)
    return path.startswith("hf://")


def read_task(eval_cfg, src, manifest: dict, tokenizer, max_seq_len: int, timeout: float):
    """An eval task's first example, as train.py's start reads the task (evals.load): its pinned
    files, the task's layout (context, choices, answer), tokenized for a model of `max_seq_len`. A
    DataError says what is wrong. `timeout`: [data] hub_timeout_seconds."""
    tasks = [t for t in eval_cfg.tasks if t.name == src.name]
    one = dataclasses.replace(eval_cfg, tasks=tasks, limit=1)
    evals.load(one, tokenizer, max_seq_len, manifest, timeout)


def read_share(data_cfg, eval_cfg, listed: list, manifest: dict, fresh: list, *, part: int, parts: int,
               streams: int, max_seq_len: int, tokenizer_path: str) -> dict:
    """{source: "" or why this node cannot use it}, for this rank's share of its node (rank `part`
    of `parts`): every parts-th local file of the manifest is there with its bytes
    (data_manifest.verify_manifest, as a run checks), and every parts-th source reads as the run
    reads it, from [data] mirror where that holds the file: a training source's first document of
    its first stream (of `streams`: the file download_data.py fetches first), a held-out source's
    first document, an eval task's first example (read_task, for a model of `max_seq_len`).
    `listed`: configured()'s; `fresh`: the sources rank 0 resolved now."""
    errors = {}  # source name -> "" or why this node cannot use it
    offline = None  # why this node cannot reach the Hub, once asked ("": it can)
    tokenizer = None  # made for the first eval task
    tasks = evals.sources(eval_cfg)
    # as train.py reads it: pinned Hub files from the mirror first
    manifest = {**manifest, "mirror": data_cfg.mirror}
    for i, (kind, src, name) in enumerate(listed):
        entry = data_manifest.manifest_entry(manifest, src, kind)
        if entry is None:  # rank 0 could not resolve it: its line says why
            continue
        alone = {"data": [entry], "validation": []}  # this source's files, checked alone
        errors[name] = data_manifest.verify_manifest(alone, part, parts)
        # not the run's files yet: this node lacks what rank 0 resolved
        if errors[name] and name in fresh:
            lacks = errors[name].split(" since ")[0]
            errors[name] = (f"{lacks} on this node, unlike on rank 0's: every node needs the same "
                            "files (the shared filesystem, or the same mirror on each node)")
        if errors[name] or i % parts != part:
            continue
        try:
            files = data_manifest.source_files(manifest, src, kind)
            training = kind == "data"
            n_streams = streams if training else 1
            timeout = data_cfg.hub_timeout_seconds
            reader = data.SourceReader(src, files, 0, n_streams, data_cfg.seed,
                                       ordered=not training, timeout=timeout)
            first = reader._files()[0] if src not in tasks else files[0]  # the file read first
            if from_hub(*first):
                if offline is None:  # one request per node, not per source
                    offline = hub_unreachable()
                if offline:
                    where, _, url = first[0].rpartition("::")
                    lacks = ""
                    if where:
                        local, _ = mirror.mirror_paths(where, url)
                        lacks = f", and {local} is not in the data mirror"
                    raise sources.DataError(offline + lacks)
            if src not in tasks:
                reader.next_text()
                continue
            tokenizer = tokenizer or data.Tokenizer(tokenizer_path)
            read_task(eval_cfg, src, manifest, tokenizer, max_seq_len, timeout)
        except sources.DataError as e:
            errors[name] = str(e)
    return errors
