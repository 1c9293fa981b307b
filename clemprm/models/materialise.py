"""A model folder built once in the cache, safe when several jobs, or the ranks of one job, ask for it at once.

Embedded and tiny models are materialised once as HF folders under the cache directory
(:func:`clemprm.models.loader.cache_root`): built in a temporary folder beside the final one under an advisory file
lock, then renamed into place, so concurrent jobs never see half-written models. A folder counts as built once its
completion marker is written; a stale, incomplete one from a killed build is replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from clemprm import distributed

_COMPLETE_MARKER = ".clemprm-complete.json"


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An advisory lock so concurrent jobs build a model once; works without it where flock is unsupported."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    locked = False
    try:
        try:
            import fcntl
            fcntl.flock(handle, fcntl.LOCK_EX)
            locked = True
        except (ImportError, OSError):  # e.g. a file system without flock: the atomic rename still protects us
            pass
        yield
    finally:
        if locked:
            import fcntl
            fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def materialise(final: Path, build) -> Path:
    """Build ``final`` with ``build(tmp_dir)`` in a temp folder beside it, then rename it into place. In a job of
    several processes rank 0 builds it and the others wait (transformers saves a model's weights and config on rank 0
    alone: a folder another rank built would lack them)."""
    if distributed.is_main():
        _build_once(final, build)
    distributed.barrier()
    return final


def _build_once(final: Path, build) -> None:
    if _is_complete(final):
        return
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            info = build(tmp) or {}
            (tmp / _COMPLETE_MARKER).write_text(json.dumps(info, indent=1, sort_keys=True))
            if final.exists():  # a stale, incomplete folder from a killed build
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
