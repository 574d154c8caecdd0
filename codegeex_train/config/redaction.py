"""Credentials never reach a file or a sink: the value of every environment variable whose name looks like a
credential (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...; values of 8+ characters) is replaced by
``<redacted>`` wherever it appears (e.g. a token pasted into a path on the command line), and so are the credentials
a string carries by its form: a URL's user information (``s3://KEY:SECRET@bucket/x`` -> ``s3://<redacted>@bucket/x``),
the values of credential-like query parameters (``?token=``, ``X-Amz-Signature=``, ``sig=``, ``api_key=``, ...) and
tokens whose prefix names them (Hugging Face ``hf_...``, GitHub ``ghp_...`` / ``github_pat_...``, GitLab
``glpat-...``, AWS access key ids ``AKIA...``), anywhere in a path.

Used by everything that records the run's flags: metrics records, wandb's config and run name, the resolved config
(``<save>/config.yaml``, every checkpoint's ``resolved_config``), the tokenizer paths a checkpoint records, error
lines that echo a path. Only what is recorded is redacted: the run itself uses the paths as given, and a config file
holding the marker is refused by ``--config`` unless the command line gives that flag (``config_file.py``)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# Environment variable names that hold credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# MLFLOW_TRACKING_PASSWORD, GITHUB_PAT, ...).
_CREDENTIAL_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|PRIVATE|_PAT$", re.IGNORECASE)
_MIN_SECRET_LENGTH = 8  # shorter values ("1", "true", "offline") would redact ordinary words
REDACTED = "<redacted>"
# scheme://userinfo@host (also scheme:/userinfo@host, what os.path.abspath leaves of it): the userinfo goes. After
# a colon anything but '@' counts, since pasted secrets keep their '/' and '+' (AWS secret keys have them).
_URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*:/+)([^/?#@\s]*:[^@\s]*|[^/?#@\s]+)@")
# ?name=value / &name=value / ;name=value, and the names whose values are credentials: tokens, keys, passwords,
# signatures (AWS X-Amz-Signature / X-Amz-Security-Token / X-Amz-Credential, Azure SAS sig, GCS X-Goog-Signature).
_QUERY_PARAMETER = re.compile(r"([?&;])([A-Za-z0-9_.-]+)=([^&#;\s]*)")
_CREDENTIAL_PARAMETER = re.compile(r"KEY|TOKEN|SECRET|PASSW|PWD|CREDENTIAL|AUTH|SIG|COOKIE|PRIVATE|SESSION",
                                   re.IGNORECASE)
# Tokens recognisable by their prefix, whether or not the environment holds them (pasted into a directory name, say).
# Their random part mixes upper and lower case (AWS key ids: 16 of [A-Z0-9]), so hf_checkpoints or ghp_notes stay.
_TOKEN_FORM = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join((
    r"hf_(?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[A-Z])[A-Za-z0-9]{30,}",  # Hugging Face
    r"gh[pousr]_(?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[A-Z])[A-Za-z0-9]{36,}",  # GitHub: classic, OAuth, app
    r"github_pat_(?=[A-Za-z0-9_]*[a-z])(?=[A-Za-z0-9_]*[A-Z])[A-Za-z0-9_]{50,}",  # GitHub: fine-grained
    r"glpat-[A-Za-z0-9_-]{20,}",  # GitLab
    r"(?:AKIA|ASIA)[A-Z0-9]{16}",  # AWS access key id
)) + r")(?![A-Za-z0-9])")


def secret_values(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The values of the credential-like variables in ``environ`` (default: this process's), longest first."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if _CREDENTIAL_NAME.search(k) and len(v) >= _MIN_SECRET_LENGTH}
    return tuple(sorted(found, key=len, reverse=True))


def redact_credential_forms(text: str) -> str:
    """``text`` with the user information of every URL in it, the values of credential-like query parameters and
    every prefixed token replaced by ``<redacted>``."""
    text = _TOKEN_FORM.sub(REDACTED, text)
    if "@" in text:
        text = _URL_USERINFO.sub(lambda m: f"{m[1]}{REDACTED}@", text)
    if "=" in text:
        text = _QUERY_PARAMETER.sub(
            lambda m: f"{m[1]}{m[2]}={REDACTED}" if m[3] and _CREDENTIAL_PARAMETER.search(m[2]) else m[0], text)
    return text


def redact_secrets(value, secrets: tuple[str, ...] | None = None):
    """``value`` (a string, or dicts / lists / tuples of them, keys included) with every secret (``secrets``,
    default: ``secret_values()``) and every credential recognisable by its form replaced by ``<redacted>``; other
    values unchanged."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return redact_credential_forms(value)
    if isinstance(value, dict):
        return {redact_secrets(k, secrets): redact_secrets(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_secrets(v, secrets) for v in value)
    return value
