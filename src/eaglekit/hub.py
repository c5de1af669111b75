"""Published drafters by hub id (``train.init_from: AQ-MedAI/Kimi-K2-Instruct-eagle3``): fetched into the Hugging
Face cache by the train stage's pre-flight, before any long work starts, and read from the cache afterwards.

Only the files a drafter is made of are fetched: ``config.json``, the weights and their index, not the optimizer
state some publishers put beside them (``training_state.pt`` of the AQ-MedAI drafter is twice the weights).
Each file goes to the cache's usual place (``blobs/<etag>``, linked from ``snapshots/<commit>/``, the branch in
``refs/``), so every Hugging Face tool finds it. It is written first to ``blobs/<etag>.part``, which survives an
interrupted run: the next run asks only for the missing bytes (an HTTP Range request). ``snapshot_download``
itself would start such a file over (it downloads to a new temporary name each time), which for a multi-GB
drafter on a flaky link is the difference between finishing and not. Sizes, and the sha256 of LFS files, are
checked before a file is put in place. ``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_TOKEN`` are read
when called, as the hub client reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from fnmatch import fnmatch
from pathlib import Path

from eaglekit import atomic
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.progress import console

DRAFTER_FILES = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(value: str) -> bool:
    """``org/name`` or ``org/name@revision`` that is not a local path."""
    return bool(HUB_ID.match(value)) and not Path(value).exists()


def split_id(value: str) -> tuple[str, str | None]:
    repo, _, revision = value.partition("@")
    return repo, revision or None


def _hub_kwargs() -> dict:
    """Endpoint and cache as the environment says now (huggingface_hub reads them once, at import)."""
    cache = os.environ.get("HF_HUB_CACHE") or (
        Path(os.environ["HF_HOME"]) / "hub" if os.environ.get("HF_HOME") else None
    )
    return {"endpoint": os.environ.get("HF_ENDPOINT") or None, "cache_dir": str(cache) if cache else None}


def cached_drafter(value: str) -> Path | None:
    """The cached snapshot of hub id ``value``, or None when it has not been downloaded completely."""
    from huggingface_hub import snapshot_download  # lazy: heavy (huggingface_hub)
    from huggingface_hub.errors import LocalEntryNotFoundError  # lazy: heavy (huggingface_hub)

    repo, revision = split_id(value)
    try:
        return Path(
            snapshot_download(
                repo, revision=revision, allow_patterns=DRAFTER_FILES, local_files_only=True, **_hub_kwargs()
            )
        )
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def download_drafter(value: str) -> Path:
    """Fetch hub id ``value`` into the cache (resuming any partial file) and return its snapshot folder."""
    from huggingface_hub import HfApi, constants  # lazy: heavy (huggingface_hub)
    from huggingface_hub.errors import (  # lazy: heavy (huggingface_hub)
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = split_id(value)
    kwargs = _hub_kwargs()
    t0 = time.monotonic()
    transport_errors: tuple[type[Exception], ...] = (HfHubHTTPError, OSError, *httpx_errors())
    console.print(
        f"init_from: downloading {value} into the Hugging Face cache (drafter files only; an interrupted "
        "download resumes where it stopped)"
    )
    try:
        api = HfApi(endpoint=kwargs["endpoint"])
        commit = api.repo_info(repo, revision=revision).sha
        if commit is None:  # the hub names every revision's commit; an endpoint that does not cannot be pinned
            raise UsageError(
                f"train.init_from {value}: the hub endpoint gave no commit for {repo} at {revision or 'main'}",
                "point init_from at a downloaded folder, or use the Hugging Face hub",
            )
        files = [
            f
            for f in api.list_repo_tree(repo, revision=commit, recursive=True)
            if hasattr(f, "size") and any(fnmatch(f.path.rsplit("/", 1)[-1], p) for p in DRAFTER_FILES)
        ]
        if not files:
            raise UsageError(
                f"train.init_from {value}: the repository holds no drafter files ({DRAFTER_FILES})",
                "point init_from at an EAGLE-3 drafter repository",
            )
        storage = Path(kwargs["cache_dir"] or constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
        for f in files:
            fetch_file(repo, commit, f, storage, kwargs["endpoint"])
        if revision is None or revision != commit:  # a branch or tag: the cache maps it to the commit
            ref = storage / "refs" / (revision or "main")
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise UsageError(
            f"train.init_from {value}: the hub has no repository {repo} you can read ({type(err).__name__})",
            "check the id, or set HF_TOKEN for a gated or private drafter",
        ) from None
    except RevisionNotFoundError:
        raise UsageError(
            f"train.init_from {value}: {repo} has no revision {revision}",
            "fix the part after @, or drop it for the main branch",
        ) from None
    except OfflineModeIsEnabled:
        raise UsageError(
            f"train.init_from {value} is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
            "unset HF_HUB_OFFLINE for the download, or download it elsewhere and point init_from at the folder",
        ) from None
    except transport_errors as err:  # network down, disk full, hub error
        raise EaglekitError(
            f"train.init_from {value}: download failed: {err}",
            "rerun the same command: complete files are kept and a partial one continues where it stopped",
        ) from None
    path = storage / "snapshots" / commit
    size = sum(f.size for f in files)
    console.print(f"init_from: {value} is in {path} ({size / 2**20:.1f} MiB, {time.monotonic() - t0:.1f} s)")
    return path


def fetch_file(repo: str, commit: str, entry, storage: Path, endpoint: str | None) -> None:
    """One file of the snapshot: appended to ``blobs/<etag>.part`` from where it stopped, checked, put in place."""
    from huggingface_hub import hf_hub_url  # lazy: heavy (huggingface_hub)
    from huggingface_hub.file_download import http_get  # lazy: heavy (huggingface_hub)
    from huggingface_hub.utils import build_hf_headers  # lazy: heavy (huggingface_hub)

    etag = entry.lfs.sha256 if entry.lfs else entry.blob_id  # the cache's blob names
    blob, link = storage / "blobs" / etag, storage / "snapshots" / commit / entry.path
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        part = blob.with_name(etag + ".part")
        with open(part, "ab") as out:
            done = out.tell()
            if done < entry.size:
                http_get(
                    hf_hub_url(repo, entry.path, revision=commit, endpoint=endpoint),
                    out,
                    resume_size=done,
                    headers=build_hf_headers(),
                    expected_size=entry.size,
                    displayed_filename=entry.path,
                )
        if part.stat().st_size != entry.size:
            raise OSError(f"{entry.path}: got {part.stat().st_size} bytes, the hub lists {entry.size}")
        if entry.lfs and sha256_of(part) != entry.lfs.sha256:
            part.unlink()  # corrupt: start this file over next time
            raise OSError(f"{entry.path}: sha256 differs from the hub's")
        os.replace(part, blob)
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def httpx_errors() -> tuple[type[Exception], ...]:
    """The transport errors of the hub client's HTTP library (httpx, or the httpx2 fork recent versions use)."""
    out: list[type[Exception]] = []
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):
            out.append(__import__(name).HTTPError)
    return tuple(out)


def local_folder(value: str) -> Path | None:
    """The folder ``train.init_from`` names: the path itself, the cached snapshot of a hub id, or None for a hub id
    that is not (completely) in the cache yet. Never downloads."""
    if Path(value).exists() or not is_hub_id(value):
        return Path(value)
    return cached_drafter(value)


def drafter_folder(value: str) -> Path:
    """The local folder of ``train.init_from``, refusing a hub id that pre-flight has not downloaded."""
    path = local_folder(value)
    if path is None:
        raise UsageError(
            f"train.init_from {value} is a hub id that is not in the Hugging Face cache",
            "run the train stage with its pre-flight (it downloads the drafter first), or `eaglekit preflight CONFIG`",
        )
    # checkpoint integrity: an eaglekit checkpoint finetuned from must be the bytes written (a published one has
    # no digests)
    atomic.refuse_damaged(path, "train.init_from", f"restore {path} from a copy, or point at another checkpoint")
    return path


# ------------------------------------------------------------------------------------- a hub id as the target


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as the hub client reads it, read when called."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def cache_storage(repo: str) -> Path:
    """The cache folder of model ``repo`` (``models--org--name``), where huggingface_hub keeps it."""
    from huggingface_hub import constants  # lazy: heavy (huggingface_hub)

    return Path(_hub_kwargs()["cache_dir"] or constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"


def cached_snapshot(value: str) -> Path | None:
    """The snapshot folder of hub id ``value`` in the cache, complete or not (the folder checks name what it
    lacks), or None when the cache holds no snapshot of that revision. Read from the cache's layout, never the
    network: ``refs/<branch>`` names the commit, ``snapshots/<commit>/`` links each file to its blob."""
    repo, revision = split_id(value)
    storage = cache_storage(repo)
    ref = storage / "refs" / (revision or "main")
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = storage / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def model_folder(value: str) -> Path | None:
    """The local folder of ``target.model``: the path itself, or the cached snapshot of a hub id (None when that is
    not in the cache). Never downloads."""
    return cached_snapshot(value) if is_hub_id(value) else Path(value)


def model_file(value: str, name: str) -> Path:
    """File ``name`` (``config.json``) of ``target.model``: from the folder, or a hub id's cached snapshot; a hub id
    not in the cache fetches just that file, as ``from_pretrained`` would, unless ``HF_HUB_OFFLINE`` is set."""
    folder = model_folder(value)
    if folder is not None and (folder / name).exists():
        return folder / name
    if not is_hub_id(value):
        return Path(value) / name  # the caller's read names the missing file
    if folder is not None:
        raise UsageError(
            f"target.model {value}: its cached snapshot {folder} has no {name}",
            f"finish the download: `hf download {split_id(value)[0]}` (or point target.model at a complete folder)",
        )
    repo, revision = split_id(value)
    if hub_offline():
        raise UsageError(
            f"target.model {value} is a hub id that is not in the Hugging Face cache ({cache_storage(repo)}), "
            "and HF_HUB_OFFLINE is set",
            f"download it where the hub is reachable (`hf download {repo}`), or point target.model at its folder",
        )
    from huggingface_hub import hf_hub_download  # lazy: heavy (huggingface_hub)

    kwargs = _hub_kwargs()
    try:
        return Path(
            hf_hub_download(repo, name, revision=revision, endpoint=kwargs["endpoint"], cache_dir=kwargs["cache_dir"])
        )
    except Exception as err:  # network, auth, a repository without the file: the user's choices are the same
        raise UsageError(
            f"target.model {value}: cannot fetch {name} from the hub ({type(err).__name__}: {err})",
            f"check the id and the network (HF_ENDPOINT / HF_TOKEN), or download it first (`hf download {repo}`)",
        ) from None


def incomplete_downloads(value: str) -> list[str]:
    """The interrupted downloads of hub id ``value`` in the cache: ``blobs/*.incomplete`` (huggingface_hub's)
    and ``blobs/*.part`` (this module's), each with the bytes it holds."""
    if not is_hub_id(value):
        return []
    blobs = cache_storage(split_id(value)[0]) / "blobs"
    partial = sorted(blobs.glob("*.incomplete")) + sorted(blobs.glob("*.part")) if blobs.is_dir() else []
    return [f"{p} ({p.stat().st_size:,} bytes, an interrupted download)" for p in partial]
