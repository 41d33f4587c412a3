"""A stage's folder in a store: the stage's name, with a sweep point's brackets written as
parentheses (`sft[lr=1e-05,rank=8]` lives in `<store>/sft(lr=1e-05,rank=8)/<id>/`).

Libraries glob inside the directories they write: Orbax merges a checkpoint step's
per-process OCDBT files by globbing `<step dir>/ocdbt.process_*`, and a `[...]` in that path
(locally, or in an s3:// or gs:// key through fsspec) reads as a character class, so the
merge finds nothing and the step cannot be restored. Parentheses mean nothing to glob, in a
shell or an object key. Stage names may not contain `( ) * ?` (flows/spec.py refuses them),
so the mapping is one to one; it is idempotent, so a folder name passed back where a stage
name is expected names the same folder.
"""

from __future__ import annotations

GLOB_CHARACTERS = "()*?"
"""Characters a pipeline's stage names may not contain (a sweep point's `[...]` aside)."""

_TO_FOLDER = str.maketrans("[]", "()")
_TO_STAGE = str.maketrans("()", "[]")


def stage_folder(stage: str) -> str:
    """The folder name of `stage`'s artifacts (a stage name or a folder name: same result)."""
    return stage.translate(_TO_FOLDER)


def folder_stage(folder: str) -> str:
    """The stage name a store folder holds (stage_folder's inverse)."""
    return folder.translate(_TO_STAGE)
