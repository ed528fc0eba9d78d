"""Turn what the user typed (a local folder or a hub id) into a local model folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

from composer.demo.packaged import EMBEDDED_NAMES, embedded_model
from composer.errors import ModelNotFoundError
from composer.logging import get_logger

logger = get_logger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/"))


def resolve_model_path(path_or_id: str | os.PathLike) -> Path:
    """A local folder as is; the embedded demo models by name ("shapes-t2v", "composer/shapes-causal"); a hub
    id from the Hugging Face cache (downloaded when online).

    Raises ModelNotFoundError with what was tried and how to fix it.
    """
    text = str(path_or_id)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(f"{text} is a file; expected a model folder (one holding model_index.json)")
    embedded = embedded_model(text)
    if embedded is not None:
        return embedded
    if not looks_like_hub_id(text) or text.startswith(f"{EMBEDDED_PREFIX}/"):
        raise ModelNotFoundError(f"model folder {text} does not exist{_did_you_mean(text)}")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - a malformed cache entry; fall through to download
        logger.debug("cache lookup for %s failed: %s", text, exc)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline:
        logger.info("%s is not in the Hugging Face cache: downloading", text)
        try:
            return Path(snapshot_download(text))
        except Exception as exc:  # noqa: BLE001 - network, auth, missing repo: all end the same way for the user
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise ModelNotFoundError(
                f"{text} is neither a local folder nor in the Hugging Face cache, and downloading it failed "
                f"({reason}). Download it where there is network (`{download_command(text)}`) and copy "
                "the cache, or pass --model-path to a local folder."
            ) from exc
    raise ModelNotFoundError(
        f"{text} is neither a local folder nor in the Hugging Face cache (HF_HUB_OFFLINE is set, so it was not "
        f"downloaded). Run `{download_command(text)}` where there is network, or pass a local folder."
    )


EMBEDDED_PREFIX = "composer"  # the embedded models' hub-style ids: composer/shapes-t2v


def _did_you_mean(text: str) -> str:
    """"; did you mean shapes-t2v?" when `text` is near an embedded model's name (a typo), else a list of them."""
    import difflib

    short = text.removeprefix(f"{EMBEDDED_PREFIX}/")
    near = difflib.get_close_matches(short, EMBEDDED_NAMES, n=1, cutoff=0.6)
    if near:
        return f"; did you mean {near[0]}?"
    return f" (embedded models: {', '.join(EMBEDDED_NAMES)}; or give a model folder or a Hugging Face hub id)"


def download_command(repo_id: str) -> str:
    """The shell command that downloads `repo_id` with the installed huggingface_hub: its `hf` CLI (0.34 on;
    1.0 dropped `huggingface-cli`), or `huggingface-cli` before that."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("huggingface_hub").split(".")[:2]
        major, minor = int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (PackageNotFoundError, ValueError, IndexError):
        return f"hf download {repo_id}"
    return f"hf download {repo_id}" if (major, minor) >= (0, 34) else f"huggingface-cli download {repo_id}"
