"""Secrets out of text a person or a file will see: a URL's password, ``password=…`` values, known secrets."""

from __future__ import annotations

import re
from collections.abc import Iterable

_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/@]*):(?P<password>[^\s@/]+)@")
_QUERY_SECRET = re.compile(r"(?P<head>\b(?:password|passwd|secret|token)=)[^&\s]+", re.I)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL password (``redis://:pw@host`` → ``redis://:***@host``), every ``password=…`` /
    ``secret=…`` / ``token=…`` value and each of ``secrets`` replaced by ``***``."""
    text = _QUERY_SECRET.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>:***@", text))
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
