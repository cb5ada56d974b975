"""A small Hugging Face Hub on 127.0.0.1, for testing data.py's hub path without the network.

It serves dataset repos laid out like `allenai/c4`, `Zyphra/Zyda-2` and `HuggingFaceTB/finemath` (README
YAML configs, the real folder and file names, schemas that differ per component), with small files
made from the bundled sample text, and answers the endpoints huggingface_hub and datasets call:

    GET /api/datasets/{repo}[/revision/{rev}]     repo info: the commit sha a revision points at
    GET /api/datasets/{repo}/tree/{rev}[/{path}]   folder listing (?recursive&expand; paginated: Link header)
    HEAD, GET /datasets/{repo}/resolve/{rev}/{path}  file content, honouring Range
    GET /api/agent-harnesses                       huggingface_hub's user-agent registry (answered: empty)

Anything else is answered 404 and logged as unhandled, so a test sees when a library starts asking for
something new. Every request is logged with its status and the body bytes sent; `faults` injects
error answers (429/5xx), stalls and a server that ignores Range for chosen paths; `redirect` sends file
reads to another URL, as the real Hub sends them to its CDN; a repo can require a token (a gated set).
"""

import gzip
import hashlib
import http.server
import json
import os
import re
import threading
import time
import urllib.parse

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets", "data")
PAGE = 4  # tree entries per page: small, so pagination is exercised (the real Hub: 1000, or 50 expanded)


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _readme(configs: dict) -> bytes:
    """A dataset card whose YAML header declares {config: {split: glob}}, as on the real repos."""
    lines = ["---", "license: odc-by", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {glob}" for split, glob in splits.items()]
    return ("\n".join(lines) + "\n---\n# A test copy\n").encode()


def _parquet(rows: list, row_group_size: int = 8) -> bytes:
    """zstd parquet with small row groups, so a resume can seek to one and read little of the file. No
    column statistics: min/max of long texts for each of these tiny row groups would make the footer
    bigger than the data (real shards hold row groups of many MB, where it does not matter)."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink, compression="zstd", row_group_size=row_group_size,
                   write_statistics=False)
    return sink.getvalue().to_pybytes()


def _jsonl_gz(rows: list) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)


def _rows(path: str) -> list:
    full = os.path.join(ASSETS, path)
    if full.endswith(".parquet"):
        return pq.read_table(full).to_pylist()
    with gzip.open(full, "rt") as f:
        return [json.loads(line) for line in f]


def make_repos() -> dict:
    """repo id -> {"commits": {sha: {path: bytes}}, "refs": {name: sha}}. Deterministic."""
    c4 = _rows("c4/en/c4-train.00000-of-00002.json.gz") + _rows("c4/en/c4-train.00001-of-00002.json.gz")
    c4_files = {f"en/c4-train.{k:05d}-of-00004.json.gz": _jsonl_gz(c4[k::4]) for k in range(4)}
    c4_files["en/c4-validation.00000-of-00001.json.gz"] = _jsonl_gz(_rows("c4/en/c4-validation.00000-of-00001.json.gz"))
    c4_files["README.md"] = c4_card = _readme({"en": {"train": "en/c4-train.*.json.gz",
                                                      "validation": "en/c4-validation.*.json.gz"},
                                               "en.noblocklist": {"train": "en.noblocklist/c4-train.*.json.gz"}})
    c4_files["en.noblocklist/c4-train.00000-of-00001.json.gz"] = _jsonl_gz([{"text": "noblocklist " * 50}] * 3)
    # An older commit with other text, reachable by its sha and by the tag "v0.1": a pinned revision reads it.
    old = {"README.md": c4_card, "en/c4-train.00000-of-00001.json.gz":
           _jsonl_gz([{"text": f"old revision document {i} " * 40, "url": "u"} for i in range(20)])}

    dclm = _rows("zyda2/data/dclm_crossdeduped/train-00000-of-00002.parquet") + \
        _rows("zyda2/data/dclm_crossdeduped/train-00001-of-00002.parquet")
    # Eight variants of each document make DCLM's shards about 1 MB, so that a resume reading one row
    # group (plus pyarrow's 64 KiB footer read) reads a small part of a file, as on the real repo.
    dclm = [{**r, "nemo_id": f"{r['nemo_id']}-{v}", "text": f"Variant {v}. {r['text']}"} for v in range(8) for r in dclm]
    fwe = _rows("zyda2/data/fwe3/train-00000-of-00002.parquet") + _rows("zyda2/data/fwe3/train-00001-of-00002.parquet")
    # Dolma-CC and Zyda-1 are not in the bundle: their rows reuse C4 text under their own schemas.
    dolma = [{"id": f"dolma-{i}", "text": r["text"], "source": "dolma-cc", "added": r["timestamp"]} for i, r in enumerate(c4[:80])]
    zyda = [{"text": r["text"], "source": "zyda", "nemo_id": f"z-{i}", "url": r["url"]} for i, r in enumerate(c4[80:160])]
    zyda2 = {"README.md": _readme({"default": {"train": "data/*/*/*"},
                                    "dclm_crossdeduped": {"train": "data/dclm_crossdeduped/*/*"},
                                    "zyda_crossdeduped-filtered": {"train": "data/zyda_crossdeduped-filtered/*/*"},
                                    "dolma-cc_crossdeduped-filtered": {"train": "data/dolma-cc_crossdeduped-filtered/*"},
                                    "fwe3": {"train": "data/fwe3/*/*"}})}
    for comp, rows, shards in [("dclm_crossdeduped", dclm, 2), ("fwe3", fwe, 2), ("zyda_crossdeduped-filtered", zyda, 1)]:
        for k in range(shards):
            zyda2[f"data/{comp}/global-shard_{k + 1:02d}_of_{shards:02d}/shard_{k:08d}_processed.parquet"] = \
                _parquet(rows[k::shards])
    zyda2["data/dolma-cc_crossdeduped-filtered/shard_00000000_processed.parquet"] = _parquet(dolma)

    fm = _rows("finemath/finemath-3plus/train-00000-of-00002.parquet") + \
        _rows("finemath/finemath-3plus/train-00001-of-00002.parquet")
    finemath = {"README.md": _readme({"finemath-3plus": {"train": "finemath-3plus/train-*"},
                                      "finemath-4plus": {"train": "finemath-4plus/train-*"}}),
                "finemath-3plus/train-00000-of-00002.parquet": _parquet(fm[0::2]),
                "finemath-3plus/train-00001-of-00002.parquet": _parquet(fm[1::2]),
                "finemath-4plus/train-00000-of-00001.parquet": _parquet([r for r in fm if r["int_score"] >= 4])}

    repos = {}
    for repo, files, history in [("allenai/c4", c4_files, {"v0.1": old}), ("Zyphra/Zyda-2", zyda2, {}),
                                 ("HuggingFaceTB/finemath", finemath, {}), ("org/gated-set", {
                                     "README.md": _readme({"default": {"train": "data/*"}}),
                                     "data/train.parquet": _parquet([{"text": "gated " * 30}] * 4)}, {})]:
        files = {".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n*.json.gz filter=lfs diff=lfs "
                 b"merge=lfs -text\n", **files}
        main = _sha(repo + "main")
        commits, refs = {main: files}, {"main": main}
        for tag, content in history.items():
            refs[tag] = _sha(repo + tag)
            commits[refs[tag]] = {".gitattributes": files[".gitattributes"], **content}
        repos[repo] = {"commits": commits, "refs": refs}
    return repos


def task_repos(n: int = 24) -> dict:
    """lm-eval's task datasets in their real layouts (file names, README configs, column types), n examples per
    split, written from the bundled sample text: Rowan/hellaswag (data/{split}-00000-of-00001.parquet, label a
    string, WikiHow's [header]/[title] markers), allenai/ai2_arc (one folder per config; choices a struct of text
    and label lists, some keyed 1-4, 3 to 5 choices) and baber/piqa (piqa_{split}.parquet at the root, no card)."""
    import random
    rnd = random.Random(0)
    words = " ".join(r["text"] for r in _rows("c4/en/c4-validation.00000-of-00001.json.gz")).split()

    def text(k):
        start = rnd.randrange(len(words) - k)
        return " ".join(words[start:start + k])

    def hellaswag(i):
        wiki = i % 3 == 0
        ctx_a = f"[header] How to {text(3)} [title] {text(5).capitalize()}." if wiki else text(rnd.randint(4, 14))
        ctx_b = "" if wiki else text(rnd.randint(0, 4))
        return {"ind": i, "activity_label": text(2).title(), "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
                "endings": [text(rnd.randint(2, 10)) + ("  [step] more" if wiki else "") for _ in range(4)],
                "source_id": f"src~{i}", "split": "val", "split_type": "indomain", "label": str(rnd.randrange(4))}

    def arc(i):
        k, numeric = rnd.choice([3, 4, 4, 4, 5]), i % 5 == 0
        labels = [str(j + 1) for j in range(k)] if numeric else list("ABCDE"[:k])
        return {"id": f"Q_{i}", "question": text(rnd.randint(4, 14)) + "?",
                "choices": {"text": [text(rnd.randint(1, 5)) for _ in range(k)], "label": labels},
                "answerKey": rnd.choice(labels)}

    def piqa(i):
        return {"goal": text(rnd.randint(3, 10)), "sol1": text(rnd.randint(3, 15)), "sol2": text(rnd.randint(3, 15)),
                "label": rnd.randrange(2)}

    splits = ("train", "validation", "test")
    hs = {f"data/{sp}-00000-of-00001.parquet": _parquet([hellaswag(i) for i in range(n)]) for sp in splits}
    hs["README.md"] = _readme({"default": {sp: f"data/{sp}-*" for sp in splits}})
    ai2 = {f"{c}/{sp}-00000-of-00001.parquet": _parquet([arc(i) for i in range(n)])
           for c in ("ARC-Challenge", "ARC-Easy") for sp in splits}
    ai2["README.md"] = _readme({c: {sp: f"{c}/{sp}-*" for sp in splits} for c in ("ARC-Challenge", "ARC-Easy")})
    pq_ = {f"piqa_{sp}.parquet": _parquet([piqa(i) for i in range(n)]) for sp in splits}
    out = {}
    for repo, files in (("Rowan/hellaswag", hs), ("allenai/ai2_arc", ai2), ("baber/piqa", pq_)):
        files = {".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n", **files}
        out[repo] = {"commits": {_sha(repo + "main"): files}, "refs": {"main": _sha(repo + "main")}}
    return out


def push(repos: dict, repo: str, files: dict, branch: str = "main") -> str:
    """A new commit on `branch`: its files with `files` added or replaced (path -> bytes). Returns its sha; the
    old commit stays readable by its sha, as on the real Hub."""
    refs = repos[repo]["refs"]
    sha = _sha(f"{repo}{refs[branch]}{sorted(files)}")
    repos[repo]["commits"][sha] = {**repos[repo]["commits"][refs[branch]], **files}
    refs[branch] = sha
    return sha


def write_mirror(repos: dict, folder: str, repo: str, revision: str = "main") -> str:
    """Write one repo's files at a revision to a local folder (what `hf download` makes): the same data offline."""
    files = repos[repo]["commits"][repos[repo]["refs"].get(revision, revision)]
    for path, body in files.items():
        full = os.path.join(folder, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(body)
    return folder


class Hub(http.server.ThreadingHTTPServer):
    """The server: `log` holds one dict per request; `faults[path] = [503, 429, "stall", "cut", "whole"]`
    answers the next requests whose URL path contains `path` with those statuses (a 429 with `retry_after`;
    None answers as usual), or: "stall" sends nothing
    for `stall_seconds` and hangs up, "cut" sends the headers and half the body, then stalls, "whole" ignores
    Range (200, the whole file). `redirect`: /resolve/ answers 302 to /cdn/..., which serves the file.
    `tokens[repo]` = the token a repo needs."""
    daemon_threads = True

    def __init__(self, repos: dict):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos, self.log, self.faults, self.tokens = repos, [], {}, {}
        self.stall_seconds, self.redirect = 30.0, False
        self.retry_after = "0"  # a 429's Retry-After header: seconds to wait
        self.lock = threading.Lock()
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request, client_address):  # a client that hangs up is no error of the test's
        pass

    def bytes_served(self, path_part: str) -> int:
        return sum(r["bytes"] for r in self.log if path_part in r["path"] and "/resolve/" in r["path"])

    def endpoints(self) -> list:
        """The distinct endpoint shapes requested, with repo ids, revisions and paths generalised."""
        shapes = set()
        for r in self.log:
            p = re.sub(r"^/api/datasets/[^/]+/[^/]+", "/api/datasets/{repo}", r["path"].split("?")[0])
            p = re.sub(r"^/datasets/[^/]+/[^/]+/resolve/[^/]+/.*", "/datasets/{repo}/resolve/{rev}/{path}", p)
            p = re.sub(r"/(revision|tree)/[^/]+(/.*)?$", lambda m: f"/{m[1]}/{{rev}}" + ("/{path}" if m[2] else ""), p)
            query = sorted(urllib.parse.parse_qs(r["path"].partition("?")[2]))
            shapes.add(f"{r['method']} {p}" + (f"?{'&'.join(query)}" if query else "") + (" Range" if r["range"] else ""))
        return sorted(shapes)

    def close(self):
        self.shutdown()
        self.server_close()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub

    def log_message(self, *args):  # the server's own stderr log would be noise in pytest
        pass

    def do_HEAD(self):
        self._handle()

    def do_GET(self):
        self._handle()

    def _send(self, status: int, body: bytes = b"", headers: dict = None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        sent = body if self.command != "HEAD" else b""
        self.wfile.write(sent)
        self.entry.update(status=status, bytes=len(sent))

    def _json(self, obj, headers: dict = None):
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, commit: str = None):
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": message}).encode(), headers)

    def _handle(self):
        hub: Hub = self.server
        url = urllib.parse.urlsplit(self.path)
        self.entry = {"method": self.command, "path": self.path, "range": self.headers.get("Range"),
                      "auth": self.headers.get("Authorization"), "status": None, "bytes": 0}
        with hub.lock:
            hub.log.append(self.entry)
            fault = next((k for k, v in hub.faults.items() if k in url.path and v), None)
            status = hub.faults[fault].pop(0) if fault else None
        if status == "stall":
            return time.sleep(hub.stall_seconds)  # then the handler returns and the connection closes
        self.fault = status if status in ("cut", "whole") else None
        if status and self.fault is None:
            return self._error(status, "", "injected fault", None) if status != 429 else \
                self._send(429, b"rate limited", {"Retry-After": hub.retry_after})
        if url.path.startswith("/cdn/"):  # where a redirect points: the same file, no second redirect
            url = url._replace(path=url.path.removeprefix("/cdn"))
        elif hub.redirect and "/resolve/" in url.path:
            return self._send(302, b"", {"Location": f"{hub.endpoint}/cdn{self.path}"})
        if url.path == "/api/agent-harnesses":  # huggingface_hub's user-agent registry: nothing to report
            return self._json({"standardEnvVars": [], "harnesses": {}})
        m = re.match(r"^/api/datasets/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?$", url.path) or \
            re.match(r"^/datasets/([^/]+/[^/]+)/(resolve)/([^/]+)/(.*)$", url.path)
        if not m:
            self.entry["unhandled"] = True
            return self._error(404, "", f"not served by the test hub: {self.command} {url.path}")
        repo_id, kind, rev = m[1], m[2] or "revision", urllib.parse.unquote(m[3] or "main")
        path = urllib.parse.unquote(m[4] or "").strip("/")
        repo, auth = hub.repos.get(repo_id), self.headers.get("Authorization")
        need = hub.tokens.get(repo_id)
        if repo is None or (need and auth != f"Bearer {need}"):
            # As the real Hub: an unknown or private repo looks the same (401 without a token, 404 with a wrong
            # one); a gated one says so.
            if need and auth is None:
                return self._error(401, "GatedRepo", f"Access to dataset {repo_id} is restricted. You must have "
                                   "access to it and be authenticated to access it. Please log in.")
            return self._error(401 if auth is None else 404, "RepoNotFound", "Repository not found")
        sha = repo["refs"].get(rev, rev)
        if sha not in repo["commits"]:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = repo["commits"][sha]
        if kind == "revision":
            return self._json({"id": repo_id, "author": repo_id.split("/")[0], "sha": sha, "private": False,
                               "gated": "auto" if need else False, "disabled": False, "downloads": 0, "likes": 0,
                               "tags": [], "lastModified": "2024-01-01T00:00:00.000Z",
                               "siblings": [{"rfilename": p} for p in sorted(files)]})
        if kind == "tree":
            return self._tree(files, path, url, sha)
        if path not in files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", sha)
        return self._file(files[path], sha)

    def _entries(self, files: dict, folder: str, recursive: bool) -> list:
        prefix = folder + "/" if folder else ""
        out, dirs = [], set()
        for p in sorted(files):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):].split("/")
            for depth in range(1, len(rest) if recursive else min(2, len(rest))):
                dirs.add(prefix + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:  # data files are in LFS, listed with their sha256 as on the Hub
                lfs = {"lfs": {"oid": hashlib.sha256(files[p]).hexdigest(), "size": len(files[p]), "pointerSize": 134}}
                out.append({"type": "file", "oid": _sha(p + str(len(files[p]))), "size": len(files[p]), "path": p,
                            **(lfs if p.endswith((".parquet", ".json.gz")) else {})})
        out += [{"type": "directory", "oid": _sha(d), "size": 0, "path": d} for d in sorted(dirs)]
        return sorted(out, key=lambda e: e["path"])

    def _tree(self, files: dict, folder: str, url, sha: str):
        query = urllib.parse.parse_qs(url.query)
        if folder and not any(p.startswith(folder + "/") for p in files):
            return self._error(404, "EntryNotFound", f"{folder} does not exist", sha)
        entries = self._entries(files, folder, query.get("recursive", ["false"])[0] == "true")
        start = int(query.get("cursor", ["0"])[0])
        headers = {}
        if start + PAGE < len(entries):
            query["cursor"] = [str(start + PAGE)]
            nxt = f"{self.server.endpoint}{url.path}?{urllib.parse.urlencode(query, doseq=True)}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._json(entries[start:start + PAGE], headers)

    def _file(self, data: bytes, sha: str):
        self.entry["size"] = len(data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        rng, status, body = self.headers.get("Range"), 200, data
        if rng and self.fault != "whole":
            start, _, end = rng.removeprefix("bytes=").partition("-")
            start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            status, body = 206, data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        if self.fault == "cut":  # the headers and half the body, then nothing until the stall ends
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            return time.sleep(self.server.stall_seconds)
        self._send(status, body, headers)


def point_libraries_at(endpoint: str, monkeypatch, cache_dir: str):
    """Aim huggingface_hub and datasets at `endpoint` in this process. Both read HF_ENDPOINT when first
    imported (maybe earlier in this pytest run), so their module constants are patched too."""
    import datasets.config
    import huggingface_hub.constants as hc
    from huggingface_hub import HfFileSystem

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):  # the developer's own token must not reach the test hub
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", os.path.join(cache_dir, "token"))  # nor a stored login
    monkeypatch.setattr(hc, "ENDPOINT", endpoint)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", os.path.join(cache_dir, "hub"))
    monkeypatch.setattr(hc, "AGENT_HARNESSES_PATH", os.path.join(cache_dir, "agent_harnesses.json"))
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", os.path.join(cache_dir, "datasets"))
    HfFileSystem.clear_instance_cache()  # an instance made earlier would keep the old endpoint and listings
