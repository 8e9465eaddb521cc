"""What the installed vLLM can take, asked once per installation: the answers are vLLM's own, and a later check
reads them from the file without importing vLLM."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from asyncrl.actors import vllm_facts
from asyncrl.actors.vllm_facts import VllmFacts, facts_file, installation, installed_vllm


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(vllm_facts.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_facts_are_vllms_own_and_a_second_ask_reads_them_without_vllm(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import AsyncEngineArgs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    asked = installed_vllm()
    assert asked is not None and asked.path.parent == cache
    assert asked.engine_arg_names() == {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert asked.cpu_head_sizes() == list(CPUAttentionBackend.get_supported_head_sizes())
    served = {arch: asked.serves_lora(arch) for arch in ("LlamaForCausalLM", "GPT2LMHeadModel", "NoSuchModel")}
    assert served == {"LlamaForCausalLM": True, "GPT2LMHeadModel": False, "NoSuchModel": None}

    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # any import of vLLM now raises
    kept = VllmFacts(asked.identity)
    assert kept.engine_arg_names() == asked.engine_arg_names()
    assert kept.cpu_head_sizes() == asked.cpu_head_sizes()
    assert {arch: kept.serves_lora(arch) for arch in served} == served
    with pytest.raises(ImportError):  # an architecture not asked before is asked of vLLM
        kept.serves_lora("Qwen2ForCausalLM")


def test_another_installation_names_another_file(cache: Path) -> None:
    identity = installation()
    assert identity is not None
    version, package, *written = identity.split("|")
    assert version == "0.32.0" and package.endswith("vllm") and len(written) == 2
    reinstalled = "|".join([version, package, str(int(written[0]) + 1), written[1]])
    assert facts_file(identity) != facts_file(reinstalled)
    assert facts_file(identity).name.startswith(f"vllm-{version}-")


def test_a_damaged_or_foreign_file_is_asked_again(cache: Path) -> None:
    identity = installation()
    assert identity is not None
    path = facts_file(identity)
    path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"identity": "another", "cpu_head_sizes": [1]}), "[]"):
        path.write_text(text)
        assert VllmFacts(identity).known == {}
    facts = VllmFacts(identity)
    assert 64 in facts.cpu_head_sizes()
    assert json.loads(path.read_text())["cpu_head_sizes"] == facts.cpu_head_sizes()


def test_a_cache_that_cannot_be_written_costs_only_the_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(vllm_facts.CACHE_DIR_ENV, str(blocked / "cache"))  # below a file: no folder can be made
    facts = installed_vllm()
    assert facts is not None and 64 in facts.cpu_head_sizes()
    assert not (blocked / "cache").exists()


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(vllm_facts.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert vllm_facts.cache_dir() == tmp_path / "xdg" / "asyncrl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert vllm_facts.cache_dir() == tmp_path / "home" / ".cache" / "asyncrl"


def test_two_processes_asking_at_once_keep_each_others_answers(cache: Path) -> None:
    identity = installation()
    assert identity is not None
    first, second = VllmFacts(identity), VllmFacts(identity)  # both read the file before either wrote
    first.cpu_head_sizes()
    second.engine_arg_names()
    second.serves_lora("GPT2LMHeadModel")
    first.serves_lora("LlamaForCausalLM")
    kept = json.loads(facts_file(identity).read_text())
    assert {"cpu_head_sizes", "engine_args"} <= set(kept)
    assert kept["lora"] == {"GPT2LMHeadModel": False, "LlamaForCausalLM": True}
