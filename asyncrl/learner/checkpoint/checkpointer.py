"""Checkpoints: what a resumed run needs that Redis does not already hold, written so that a crash never leaves half
of one. :class:`Checkpointer` writes them and loads the engines back from one (collective under data parallelism:
every rank calls it).

A save writes the engines' DeepSpeed state, the policy as a Hugging Face folder and the run state into
``.tmp-step-<N>/``, fsyncs and hashes every file into the manifest, and only then renames the folder to ``step-<N>``
(atomic), then prunes old checkpoints. The folder's files, the manifest and the verification a resume does before it
trusts one: :mod:`asyncrl.learner.checkpoint.format`; finding, keeping and setting aside checkpoints:
:mod:`asyncrl.learner.checkpoint.history`; the settings a resume must match:
:mod:`asyncrl.learner.checkpoint.settings`.

**A save that fails** removes its ``.tmp-step-<N>/``; when the disk refused it (full, read-only, not writable) the
learner stops with one line (:class:`CheckpointError`, also logged) that names the
folder, its mount point and free bytes, and what to do (:mod:`asyncrl.learner.checkpoint.disk`). A save removes a
``.tmp-step-<N>`` of its own name before it starts, and a learner removes those of saves that died when it starts.

**What lives where.** The control plane and the replay stream live in Redis (AOF-persisted) and are *not* rolled back
by a resume: group ids, the ``created``/``released`` counters (the prompt stream's position), the in-flight ledger,
the queue, the replay stream and its consumer group hold groups that the discarded steps never saw, and rolling them
back would reuse ids or lose work. The checkpoint holds only what Redis cannot: the model and optimizer, the KL
controller, the RNGs, the step. The positions in ``state.json`` (dispatcher counters, the consumer group's
last-delivered id) are a record for people and for a resume into an empty Redis (:meth:`Dispatcher.adopt`).

**Exactly once.** The groups trained after the checkpoint are the only ones whose effect a resume loses; Redis knows
which they are (:mod:`asyncrl.learner.intake.trained`): their replay entries are acknowledged only once a checkpoint
covers them, so a resume takes their ids out of the ``done`` set and trains them again from the pending list. Every
other group is either in the checkpoint (trained at or before its step) or not trained yet (queued, in flight, or in the
stream). Resuming from an older checkpoint than the latest, the groups trained between the two were acknowledged by the
later one and cannot be read again: they are counted lost (``restore_lost`` in the dispatcher's counters) and admission
releases replacements; the later checkpoints move to ``discarded/`` so that ``latest`` never picks one of them.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from asyncrl.common.config import RunConfig
from asyncrl.common.observability import metrics as m
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.private import private_dir
from asyncrl.learner import dist, ranks
from asyncrl.learner.checkpoint.disk import disk_refusal, remove_partial_saves
from asyncrl.learner.checkpoint.format import (
    DS_TAG,
    STATE,
    Checkpoint,
    CheckpointError,
    SavedState,
    _fsync,
    capture_rng,
    write_manifest,
)
from asyncrl.learner.checkpoint.history import prune
from asyncrl.learner.checkpoint.settings import check_world_size
from asyncrl.learner.update import lora

if TYPE_CHECKING:
    from peft import LoraConfig

    from asyncrl.learner.update.critic import ValueEngine
    from asyncrl.learner.update.engine import PolicyEngine

log = get_logger("checkpoint")


class Checkpointer:
    """Saves and loads the checkpoints of one run (collective under data parallelism: every rank calls it)."""

    def __init__(
        self, config: RunConfig, policy: PolicyEngine, critic: ValueEngine | None = None, tokenizer: Any = None
    ) -> None:
        self.config = config
        self.policy = policy
        self.critic = critic
        self.tokenizer = tokenizer
        self.root = config.run_dir / "checkpoints"
        if dist.rank() == 0:
            remove_partial_saves(self.root)

    def save(self, state: SavedState) -> Path:
        """Write ``state`` and the engines to ``step-<N>`` (temporary folder, manifest, rename), then prune.

        A failed save removes its temporary folder; a disk that refused it raises :class:`CheckpointError` naming
        the disk (:func:`~asyncrl.learner.checkpoint.disk.disk_refusal`). Collective: a rank whose DeepSpeed shard
        failed fails every rank's save.
        """
        started = time.perf_counter()
        final, tmp = self.root / f"step-{state.step}", self.root / f".tmp-step-{state.step}"
        ranks.lead("save", state)
        state.has_critic = self.critic is not None
        state.world_size = dist.world_size()
        state.rank_rngs = dist.all_gather_object(capture_rng())[1:]
        try:
            entries = self._write(state, tmp, final)
        except Exception as exc:
            refusal = disk_refusal(exc, tmp)  # the free bytes at the failure, before the clean-up gives some back
            if refusal is not None:
                _release_files(exc)
            if dist.rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if refusal is None:
                raise
            if tmp.exists():
                refusal += f"; {tmp} could not be removed either (ignored by a resume; delete it when you can)"
            log.error("checkpoint not saved", step=state.step, reason=state.reason, problem=refusal)
            raise CheckpointError(refusal) from exc
        if dist.rank() == 0:
            self._log_saved(state, final, entries, time.perf_counter() - started)
            prune(self.root, self.config.checkpoint.keep, self.config.checkpoint.keep_best)
        dist.barrier()
        return final

    def _write(self, state: SavedState, tmp: Path, final: Path) -> dict[str, dict[str, Any]]:
        """The files of :meth:`save` into ``tmp``, then renamed to ``final`` (rank 0); the manifest's entries."""
        if dist.rank() == 0:
            _remove_partial(tmp)  # of a save of this step that died: a fresh folder, never a FileExistsError
            private_dir(tmp)  # 0700 (the weights); what DeepSpeed writes in it follows the umask
        dist.barrier()
        failed = None
        # A LoRA run's frozen base is model.path itself: the checkpoint holds the adapters (and a critic's value head)
        # with their optimizer state.
        frozen_left_out = self.config.lora.enabled
        try:
            self.policy.engine.save_checkpoint(
                str(tmp / "policy"), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=frozen_left_out
            )
            if self.critic is not None:
                self.critic.engine.save_checkpoint(
                    str(tmp / "critic"), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=frozen_left_out
                )
        except (OSError, RuntimeError) as exc:  # told to every rank first, so that none waits for a shard
            failed = exc
        problems = [p for p in dist.all_gather_object(None if failed is None else str(failed)) if p is not None]
        if failed is not None:
            raise failed
        if problems:
            raise RuntimeError(f"another learner rank could not write its checkpoint shard: {problems[0]}")
        params = self.policy.full_state_dict() if self.config.checkpoint.export_hf else {}
        adapters = self.policy.state_dict_for_broadcast() if self.config.lora.enabled else {}
        entries: dict[str, dict[str, Any]] = {}
        if dist.rank() == 0:
            if self.config.checkpoint.export_hf:
                export_hf(self.policy.module, params, self.tokenizer, tmp / "hf")
            if adapters:
                export_adapter(self.policy.module, adapters, tmp / "adapter")
            (tmp / STATE).write_text(state.to_json())
            entries = write_manifest(tmp)
            _replace(tmp, final)
        return entries

    def _log_saved(self, state: SavedState, path: Path, entries: dict[str, dict[str, Any]], seconds: float) -> None:
        parts: dict[str, int] = {}
        for name, meta in entries.items():
            part = name.split("/", 1)[0] if "/" in name else "state"
            parts[part] = parts.get(part, 0) + int(meta["bytes"])
        log.info(
            "saved checkpoint",
            step=state.step,
            reason=state.reason,
            path=path,
            bytes=sum(parts.values()),
            **{f"{part}_bytes": size for part, size in sorted(parts.items())},
            seconds=round(seconds, 3),
        )
        m.LEARNER_CHECKPOINT_BYTES.set(sum(parts.values()))

    def load(self, checkpoint: Checkpoint) -> SavedState:
        """Load the engines' weights, optimizer and scheduler state from a verified checkpoint; its run state."""
        ranks.lead("restore", checkpoint)
        state = checkpoint.state
        check_world_size(checkpoint, dist.world_size())
        if state.has_critic != (self.critic is not None):
            have = "a critic" if self.critic is not None else "no critic"
            raise CheckpointError(
                f"{checkpoint.path} was saved by a run {'with' if state.has_critic else 'without'} a critic, and this "
                f"config has {have}; resume with the config the run was started with"
            )
        _load_engine(self.policy.engine, checkpoint.path / "policy", whole=not self.config.lora.enabled)
        if self.critic is not None:
            _load_engine(self.critic.engine, checkpoint.path / "critic", whole=not self.config.lora.enabled)
        m.LEARNER_CHECKPOINT_BYTES.set(checkpoint.bytes)  # the disk alert's measure from the start, not the next save
        return state


def _load_engine(engine: Any, folder: Path, whole: bool = True) -> None:
    """Load one engine's DeepSpeed state; ``whole = False``: the checkpoint left the frozen parameters out (a LoRA
    run's base, loaded from ``model.path`` already)."""
    path, _ = engine.load_checkpoint(
        str(folder), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=whole
    )
    if path is None:
        raise CheckpointError(f"{folder / DS_TAG}: DeepSpeed found no checkpoint to load; resume from another one")


def export_hf(module: torch.nn.Module, params: dict[str, torch.Tensor], tokenizer: Any, out: Path) -> Path:
    """The policy as a Hugging Face folder: ``params`` (full weights, named as in the HF checkpoint; a LoRA run's
    merged) as safetensors, the model's config, and the tokenizer. transformers' ``AutoModelForCausalLM`` and vLLM load
    it as is."""
    get_base_model = getattr(module, "get_base_model", None)  # under PEFT's wrapper
    hf_model = get_base_model() if get_base_model is not None else module
    hf_model.save_pretrained(out, state_dict=params, safe_serialization=True)  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def export_adapter(module: torch.nn.Module, adapters: dict[str, torch.Tensor], out: Path) -> Path:
    """A LoRA run's adapters as a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``):
    ``peft.PeftModel.from_pretrained`` and vLLM's LoRA requests load it over the base model (``model.path``), which
    the config names by an absolute path when it is a local folder
    (:func:`asyncrl.learner.update.lora.base_model_reference`): it loads from any working directory."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_config = cast("dict[str, LoraConfig]", module.peft_config)  # under PEFT's wrapper
    settings = copy.copy(peft_config[lora.ADAPTER])  # the policy's own settings stay as they are
    settings.base_model_name_or_path = lora.base_model_reference(settings.base_model_name_or_path)
    settings.save_pretrained(str(out))
    save_file({name: value.contiguous() for name, value in adapters.items()}, out / "adapter_model.safetensors")
    return out


def _replace(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; a checkpoint of the same step (a discarded history's) is removed."""
    if final.exists():
        log.warning("replaced a checkpoint of the same step from steps a resume discarded", path=final)
        shutil.rmtree(final)
    os.replace(tmp, final)
    with contextlib.suppress(OSError):  # directory fsync: not supported everywhere
        _fsync(final.parent)


def _release_files(exc: BaseException) -> None:
    """Drop the local variables of the frames ``exc`` (and what it was raised from) went through: a writer that
    failed mid-file (torch's zip writer) still holds its file open from there, and a deleted file that is open keeps
    its space on the disk until the error object is gone."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        traceback.clear_frames(chain.__traceback__)
        chain = chain.__cause__ or chain.__context__


def _remove_partial(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # raises: a folder that cannot be removed is the disk's refusal, named by the caller
        log.warning("removed a checkpoint folder that a save left unfinished", path=tmp)
