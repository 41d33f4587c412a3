"""What a store location is: a local path, or a URL that fsspec opens (s3://, gs://, or any
other scheme but file://, e.g. memory:// in tests). The one test of it, for the store's
interface and its backends alike; it imports no backend."""

from __future__ import annotations


def is_url(root: str) -> bool:
    """Whether `root` is a URL (reached through fsspec) rather than a local path."""
    return "://" in root and not root.startswith("file://")
