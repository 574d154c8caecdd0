"""Credentials never reach a sink: the value of every environment variable whose name looks like a credential
(``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...; values of 8+ characters) is replaced by ``<redacted>``
wherever it appears (e.g. a token pasted into a path on the command line)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# Environment variable names that hold credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# MLFLOW_TRACKING_PASSWORD, GITHUB_PAT, ...).
_CREDENTIAL_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|PRIVATE|_PAT$", re.IGNORECASE)
_MIN_SECRET_LENGTH = 8  # shorter values ("1", "true", "offline") would redact ordinary words
REDACTED = "<redacted>"


def secret_values(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The values of the credential-like variables in ``environ`` (default: this process's), longest first."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if _CREDENTIAL_NAME.search(k) and len(v) >= _MIN_SECRET_LENGTH}
    return tuple(sorted(found, key=len, reverse=True))


def redact_secrets(value, secrets: tuple[str, ...] | None = None):
    """``value`` (a string, or dicts / lists / tuples of them, keys included) with every secret replaced by
    ``<redacted>``; other values unchanged."""
    secrets = secret_values() if secrets is None else secrets
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact_secrets(k, secrets): redact_secrets(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_secrets(v, secrets) for v in value)
    return value
