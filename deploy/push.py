"""Draft heads into the cluster: upload a trained head (or draft model) directory to a Hugging Face
hub repository, the place vLLM and SGLang pull drafters from (and the built-in server's init
container downloads them from). huggingface_hub's own client: HF_ENDPOINT, token from HF_TOKEN.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tuner.schema.config import UserError

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_drafter_dir(folder: Path) -> None:
    """A directory the engines load as a drafter: config.json plus safetensors weights."""
    if not folder.is_dir():
        raise UserError(f"{folder}: no such directory (give a run directory or a head directory)")
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise UserError(f"{folder}: not a draft head or model directory (needs config.json and *.safetensors, "
                        "as `tuner train-draft` writes them)")


def push_dir(folder: Path, repo_id: str, private: bool = False, message: str | None = None) -> str:
    """Create `repo_id` if needed and upload every file of `folder` in one commit; returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if not REPO_ID.fullmatch(repo_id):
        raise UserError(f"--to {repo_id}: not a hub repository id (allowed: ORG/NAME, letters, digits, - _ .)")
    check_drafter_dir(folder)
    # The endpoint is read now (not at import), so a process may point HF_ENDPOINT elsewhere.
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(repo_id, exist_ok=True, private=private)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id,
                                 commit_message=message or f"spectune: draft head {folder.name}")
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else "?"
        raise UserError(f"--to {repo_id}: the hub at {api.endpoint} answered {code} "
                        f"(HF_TOKEN {'set' if os.environ.get('HF_TOKEN') else 'unset'}: a token with write access "
                        "is needed)") from None
    except OSError as exc:  # connection refused, DNS
        raise UserError(f"--to {repo_id}: the hub at {api.endpoint} cannot be reached ({exc})") from None
    return str(info.commit_url)
