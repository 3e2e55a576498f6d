"""Output folders of ``demo``, ``train`` and ``sweep``: checked before anything trains, and
never overwritten without ``overwrite``.

:func:`output_folder` settles where a command writes: a missing folder is made, a folder that
already holds results is left alone (a new one beside it takes the results, and a note says
which) unless ``overwrite`` is given, and a path that cannot be a writable folder (a file, a
folder under a file, a read-only place) is a ``ValueError`` at once, not after the training.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence, Union

__all__ = ["RESULT_FILES", "output_folder"]

# What the commands write; a folder holding none of these (or nothing at all) is free to use.
RESULT_FILES = ("metrics.json", "table.md", "table.csv", "demo.png", "train.png",
                "checkpoint.pt", "model.pt", "sweep.json", "sweep.md", "sweep.csv")


def _holds_results(folder: Path) -> bool:
    return any((folder / name).exists() for name in RESULT_FILES)


def _check_writable(folder: Path) -> None:
    """Make ``folder`` (and its parents) and write a scratch file there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"--out {str(folder)!r} is not a writable folder "
                         f"({exc.strerror or exc})") from None


def output_folder(out: Optional[Union[str, os.PathLike]], command: str,
                  overwrite: bool = False,
                  keep: Sequence[str] = ()) -> tuple[Path, Optional[str]]:
    """The folder ``command`` writes its results into, made and checked writable, and a note
    when it is not the one asked for.

    ``out`` None: ``runs/<command>-<date>-<time>`` (with ``-2``, ``-3``... when that exists).
    A folder that holds results of an earlier run (:data:`RESULT_FILES`) is used only with
    ``overwrite`` (its result files are then removed first, so that no stale file is mixed
    with the new ones, but for those named in ``keep``); otherwise the first free ``<out>-2``, ``<out>-3``... is used and the
    note says so. Raises ``ValueError`` for an ``out`` that is a file or cannot be written.
    """
    if out is None:
        base = Path("runs") / time.strftime(f"{command}-%Y%m%d-%H%M%S")
        asked = None
    else:
        base = asked = Path(out).expanduser()
    if base.exists() and not base.is_dir():
        raise ValueError(f"--out {str(base)!r} exists and is not a folder")
    folder, note = base, None
    if base.is_dir() and _holds_results(base):
        if overwrite and asked is not None:
            for name in RESULT_FILES:
                if name not in keep:
                    (base / name).unlink(missing_ok=True)
        else:
            folder = next(f for f in (Path(f"{base}-{i}") for i in itertools.count(2))
                          if not f.exists() or (f.is_dir() and not any(f.iterdir())))
            if asked is not None:
                note = (f"{base} holds the results of an earlier run; writing to {folder} "
                        "instead (--overwrite replaces them)")
    _check_writable(folder)
    return folder, note
