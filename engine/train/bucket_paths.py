"""Checkpoint directories at a bucket URL: every process reads and writes its own shards there.

Orbax writes `gs://` through TensorStore's GCS driver itself. For `s3://` it needs three
things that orbax-checkpoint 0.12 does not do (measured against moto's S3 server):

- etils' path layer must use fsspec (s3fs) rather than TensorFlow's `gfile`, which it picks
  whenever TensorFlow is installed and which has no S3: `EPATH_USE_TF=false` (for gs:// too:
  gcsfs, the store's own file system, which honours STORAGE_EMULATOR_HOST as gfile does not;
  TensorStore's GCS driver is pointed at the emulator through TENSORSTORE_GCS_HTTP_URL);
- Orbax builds TensorStore specs only for local and GCS paths ("Checkpoint path should be
  absolute"); TensorStore's own `s3` kvstore driver (endpoint and region from the AWS
  environment variables, credentials from them where they hold keys, else from the AWS
  chain) reads and writes OCDBT there;
- a step is committed by a `commit_success.txt` file, as on GCS, not by a directory rename
  (S3 has none): Orbax's CommitFileTemporaryPath.

`checkpoint_path` is where the engine turns a checkpoint directory into a path: a local one
absolute, a URL an etils path with the above in place. A step written at a URL is whole once
its digests.json is there (engine/train/checkpoint.py writes it at Orbax's finalize, before
the commit file), and `resume_step` trusts no other sign.
"""

from __future__ import annotations

import os
from pathlib import Path

import orbax.checkpoint as ocp
from etils import epath
from etils.epath import gpath
from orbax.checkpoint._src.path import atomicity, gcs_utils
from orbax.checkpoint._src.serialization import tensorstore_utils

from engine.config import ConfigError
from engine.data.urls import is_url

_PATCHED = False


def checkpoint_path(directory: str | os.PathLike) -> Path | epath.Path:
    """A checkpoint directory as the engine opens it: a URL (gs://, s3://) as an etils path
    that Orbax and TensorStore write themselves, anything else as an absolute local path."""
    text = str(directory)
    if is_url(text):
        _use_fsspec_paths()
    if text.startswith("s3://"):
        _enable_s3()
    if text.startswith("gs://") and os.environ.get("STORAGE_EMULATOR_HOST"):
        # An emulator (gcsfs reads STORAGE_EMULATOR_HOST itself): TensorStore's GCS driver too,
        # without credentials, as gcsfs talks to an emulator. Otherwise TensorStore's auth chain
        # runs first (the gcloud credentials file, then a probe of the GCE metadata server): in
        # a CI run an engine stalled there for 600 s before its first checkpoint request.
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", os.environ["STORAGE_EMULATOR_HOST"])
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    if is_url(text):
        return epath.Path(text)
    if "://" in text:
        raise ConfigError(f"checkpoint directory {text}: only local paths, gs:// and s3:// URLs are supported")
    return Path(text).absolute()


def temporary_path_class(directory: Path | epath.Path) -> type:
    """How a step commits in `directory`: a rename locally, a commit file in a bucket."""
    if str(directory).startswith("s3://"):
        return atomicity.CommitFileTemporaryPath
    return ocp.path.atomicity_defaults.get_default_temporary_path_class(epath.Path(directory))


def s3_kvstore(url: str) -> dict:
    """TensorStore's spec of the S3 prefix `url` (s3://bucket/path)."""
    bucket, _, path = url.removeprefix("s3://").partition("/")
    spec: dict[str, object] = {"driver": "s3", "bucket": bucket, "path": path}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        # Keys in the environment: only that provider. TensorStore's default chain also reads
        # ~/.aws/config and ~/.aws/credentials, and logs ERROR lines into the stage's output
        # for each it cannot open, even when the environment's keys are the ones it uses.
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _use_fsspec_paths() -> None:
    """etils' paths at a URL through fsspec (s3fs, gcsfs), the file systems the store uses."""
    if os.environ.get("EPATH_USE_TF") != "false":
        os.environ["EPATH_USE_TF"] = "false"  # read by etils once (cached): cleared here
        getattr(getattr(gpath, "_is_tf_installed", None), "cache_clear", lambda: None)()


def _enable_s3() -> None:
    """Teach this process's Orbax the s3:// paths (once)."""
    global _PATCHED
    if _PATCHED:
        return
    use_gcs_driver = getattr(tensorstore_utils, "_use_gcs_driver", None)
    normalize = getattr(tensorstore_utils, "_normalize_path", None)
    gcs_kvstore = getattr(gcs_utils, "get_kvstore_for_gcs", None)
    if not (use_gcs_driver and normalize and gcs_kvstore):
        raise ConfigError(
            "checkpoint directories at s3:// need orbax-checkpoint's TensorStore spec hooks "
            "(tensorstore_utils._use_gcs_driver, _normalize_path, gcs_utils.get_kvstore_for_gcs), "
            "which this orbax-checkpoint release does not have; use gs:// or a local path"
        )

    # Orbax asks "GCS driver?" and then builds the kvstore spec for it: answer yes for s3://
    # too and build TensorStore's s3 spec there; gs:// and local paths are left as they were.
    tensorstore_utils._use_gcs_driver = lambda directory: directory.startswith("s3://") or use_gcs_driver(directory)
    tensorstore_utils._normalize_path = lambda path: normalize(path).replace("s3:/", "s3://", 1)
    gcs_utils.get_kvstore_for_gcs = lambda path: s3_kvstore(path) if path.startswith("s3://") else gcs_kvstore(path)
    _PATCHED = True
