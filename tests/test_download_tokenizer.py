"""Tests for download_tokenizer.py against a fake Hugging Face Hub on 127.0.0.1.

The fake server implements only what `hf_hub_download` needs for a plain (non-Xet) file:
HEAD and GET on /{repo_id}/resolve/{revision}/{filename}, answering with X-Repo-Commit, ETag and
Content-Length, or with the X-Error-Code / X-Error-Message headers the real Hub uses for errors.
The script always runs as a subprocess with HF_ENDPOINT pointed at the fake server, so nothing
leaves the loopback interface.
"""

import hashlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "download_tokenizer.py")

TOKENIZER_BYTES = b"IQ== 0\nIg== 1\nIw== 2\n" * 100  # looks like a tiktoken BPE file
ROOT_TOKENIZER_BYTES = b"root-level tokenizer\n"
GOOD_TOKEN = "hf_GoodTokenValue1234567890"
BAD_TOKEN = "hf_BadTokenValue0987654321"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# repo_id -> {filename: content}; "org/gated" exists but no token is ever granted access to it.
REPOS = {
    "org/llama": {"original/tokenizer.model": TOKENIZER_BYTES, "tokenizer.model": ROOT_TOKENIZER_BYTES},
    "org/no-original": {"tokenizer.model": ROOT_TOKENIZER_BYTES},
    "org/gated": {"original/tokenizer.model": TOKENIZER_BYTES},
}


class FakeHub(http.server.BaseHTTPRequestHandler):
    requests = []  # (method, path, Authorization header), appended by the handler threads

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _error(self, status, code=None, message=None):
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _handle(self, send_body):
        auth = self.headers.get("Authorization")
        FakeHub.requests.append((self.command, self.path, auth))
        parts = self.path.split("?")[0].lstrip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(404)
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[4:])
        # Mirror the real Hub: a token it does not know is rejected before anything else.
        if auth is not None and auth != f"Bearer {GOOD_TOKEN}":
            return self._error(401, message="Invalid credentials in Authorization header")
        if repo_id not in REPOS:
            return self._error(401 if auth is None else 404, "RepoNotFound", "Repository not found")
        if repo_id == "org/gated":
            msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            return self._error(401 if auth is None else 403, "GatedRepo", msg)
        if filename not in REPOS[repo_id]:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        body = REPOS[repo_id][filename]
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def do_HEAD(self):
        self._handle(send_body=False)

    def do_GET(self):
        self._handle(send_body=True)


@pytest.fixture(scope="module")
def hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_script(endpoint, tmp_path, *args, env_token=None, skip_sleeps=False):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING_FACE_")) and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2", NO_PROXY="127.0.0.1,localhost")
    if env_token is not None:
        env["HF_TOKEN"] = env_token
    cmd = [sys.executable, SCRIPT, *args]
    if skip_sleeps:
        # huggingface_hub retries network errors 5 times with 1+2+4+8+8 s of back-off and has no
        # knob for it; run the real script unchanged, but with time.sleep stubbed out.
        shim = ("import runpy, sys, time; time.sleep = lambda s: None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        cmd = [sys.executable, "-c", shim, SCRIPT, *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def one_line(text):
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    return lines[0]


def test_success_default_local_dir(hub, tmp_path):
    r = run_script(hub, tmp_path, "--repo_id", "org/llama", "--tokenizer_path", "original")
    assert r.returncode == 0, r.stderr
    out_path = tmp_path / "assets" / "tokenizer" / "original" / "tokenizer.model"
    assert out_path.read_bytes() == TOKENIZER_BYTES
    line = one_line(r.stdout)
    assert "assets/tokenizer/original/tokenizer.model" in line and f"{len(TOKENIZER_BYTES):,}" in line
    assert r.stderr == ""
    # A second run finds the up-to-date file and still succeeds.
    r = run_script(hub, tmp_path, "--repo_id", "org/llama", "--tokenizer_path", "original")
    assert r.returncode == 0 and out_path.read_bytes() == TOKENIZER_BYTES


def test_repo_root_tokenizer_path_and_local_dir(hub, tmp_path):
    r = run_script(hub, tmp_path, "--repo_id", "org/no-original", "--tokenizer_path", "",
                   "--local_dir", str(tmp_path / "tok"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tok" / "tokenizer.model").read_bytes() == ROOT_TOKENIZER_BYTES
    one_line(r.stdout)


@pytest.mark.parametrize("via_env", [False, True])
def test_token_is_sent_and_never_printed(hub, tmp_path, via_env):
    FakeHub.requests.clear()
    args = ["--repo_id", "org/llama", "--tokenizer_path", "original", "--local_dir", str(tmp_path / "t")]
    if via_env:
        r = run_script(hub, tmp_path, *args, env_token=GOOD_TOKEN)
    else:
        r = run_script(hub, tmp_path, *args, "--hf_token", GOOD_TOKEN)
    assert r.returncode == 0, r.stderr
    assert FakeHub.requests and all(auth == f"Bearer {GOOD_TOKEN}" for _, _, auth in FakeHub.requests)
    assert GOOD_TOKEN not in r.stdout + r.stderr


@pytest.mark.parametrize("repo_id,tokenizer_path,token,expected", [
    ("org/gated", "original", None, "no access"),
    ("org/gated", "original", GOOD_TOKEN, "no access"),
    ("org/llama", "nope", GOOD_TOKEN, "nope/tokenizer.model"),
    ("org/no-original", "original", None, "original/tokenizer.model"),
    ("org/does-not-exist", "original", None, "not found"),
    ("org/does-not-exist", "original", GOOD_TOKEN, "not found"),
    ("org/llama", "original", BAD_TOKEN, "access token"),
])
def test_errors_are_one_line_exit_1(hub, tmp_path, repo_id, tokenizer_path, token, expected):
    args = ["--repo_id", repo_id, "--tokenizer_path", tokenizer_path, "--local_dir", str(tmp_path / "t")]
    if token:
        args += ["--hf_token", token]
    r = run_script(hub, tmp_path, *args)
    assert r.returncode == 1
    assert r.stdout == ""
    line = one_line(r.stderr)
    assert line.startswith("error: ") and expected in line and "Traceback" not in r.stderr
    if token:
        assert token not in r.stdout + r.stderr
    assert not (tmp_path / "t" / tokenizer_path / "tokenizer.model").exists()


def test_unreachable_endpoint(tmp_path):
    with socket.socket() as s:  # grab a free loopback port, then close it so connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    r = run_script(f"http://127.0.0.1:{port}", tmp_path, "--repo_id", "org/llama", "--tokenizer_path",
                   "original", "--hf_token", BAD_TOKEN, skip_sleeps=True)
    assert time.monotonic() - start < 15
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "network" in line and "Traceback" not in r.stderr
    assert BAD_TOKEN not in r.stdout + r.stderr
