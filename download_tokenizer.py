"""Download the Llama-3 tokenizer (tiktoken BPE file) from the Hugging Face Hub.

Usage:
    python download_tokenizer.py --repo_id meta-llama/Llama-3.1-8B --tokenizer_path original

The file lands at <local_dir>/<tokenizer_path>/tokenizer.model, by default
assets/tokenizer/original/tokenizer.model, which is what the configs' `tokenizer_path` points at.
Meta's repos are gated: request access on the model page first. Pass a token with --hf_token;
without it, the HF_TOKEN env var (or a token saved by `hf auth login`) is used.
Use --tokenizer_path "" if the file sits at the repo root.
"""
import argparse
import os
import sys

from huggingface_hub import constants, hf_hub_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                    RemoteEntryNotFoundError, RepositoryNotFoundError)
from huggingface_hub.utils import disable_progress_bars, logging as hf_logging


def main() -> int:
    about = "Download tokenizer.model from a Hugging Face model repo."
    p = argparse.ArgumentParser(description=about)
    p.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-3.1-8B")
    p.add_argument("--tokenizer_path", required=True,
                   help='folder of tokenizer.model in the repo ("" = root)')
    p.add_argument("--hf_token", default=None,
                   help="access token (default: HF_TOKEN env var / saved login)")
    p.add_argument("--local_dir", default="assets/tokenizer")
    args = p.parse_args()

    # The Hub always uses "/" in file names, whatever the OS.
    folder = args.tokenizer_path.strip("/")
    filename = f"{folder}/tokenizer.model" if folder else "tokenizer.model"
    repo = args.repo_id
    token = args.hf_token  # None lets huggingface_hub read HF_TOKEN itself

    def fail(msg: str) -> int:
        # One line, and never leak the token even if some server echoes it back into a message.
        msg = " ".join(msg.split())
        print("error: " + (msg.replace(token, "***") if token else msg), file=sys.stderr)
        return 1

    # The library logs retry warnings and draws progress bars on stderr: keep stderr to one line.
    hf_logging.set_verbosity_error()
    disable_progress_bars()
    try:
        path = hf_hub_download(repo, filename, local_dir=args.local_dir, token=token)
    # Order matters: GatedRepoError subclasses RepositoryNotFoundError, and every HTTP error
    # subclasses HfHubHTTPError.
    except GatedRepoError:
        return fail(f"{repo} is gated and you have no access: "
                    f"request it at {constants.ENDPOINT}/{repo}, then pass --hf_token "
                    "(or set HF_TOKEN) for the account that was granted access")
    except RepositoryNotFoundError:
        return fail(f"repo {repo} not found, or it is private/gated and no valid token was sent: "
                    "check --repo_id and --hf_token / HF_TOKEN")
    except RemoteEntryNotFoundError:
        return fail(f"{filename} not found in {repo}: "
                    "check --tokenizer_path ('' means the repo root)")
    except HfHubHTTPError as e:
        # The Hub answers 401 "Invalid credentials in Authorization header" for a bad/expired token.
        if e.response is not None and e.response.status_code == 401:
            return fail("the Hub rejected the access token (HTTP 401): check --hf_token / HF_TOKEN")
        return fail(f"Hub request failed: {e}")
    except LocalEntryNotFoundError:
        # huggingface_hub turns connection errors and timeouts into this once its retries are spent.
        return fail(f"could not reach {constants.ENDPOINT} and no local copy exists: "
                    "check your network connection "
                    "(or HF_ENDPOINT / proxy settings / HF_HUB_OFFLINE)")
    except Exception as e:  # e.g. a connection dropped mid-download or an invalid repo id
        return fail(f"download failed: {type(e).__name__}: {e}")
    print(f"saved {path} ({os.path.getsize(path):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
