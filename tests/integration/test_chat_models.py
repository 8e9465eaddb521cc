"""Models as users bring them: a byte-level BPE tokenizer with a ChatML template, in three architectures (Llama, Qwen2
with a padded, tied embedding, and Qwen3 with a thinking model's template), built locally
(``common/tiny_models/chat.py``) and served by a real ``rl-actor``.

The token path is checked end to end: the dispatcher templates and encodes each prompt once; a real vLLM engine
samples from those ids; the learner's BatchSource reads the scored groups back from Redis and its batch holds
exactly the ids the actor generated — the prompt as the dispatcher made it, the response (with the template's end
of turn) as vLLM sampled it — and vLLM's behaviour log-probs of those ids equal a transformers forward pass. The
actor takes 16 groups of long prompts at once, more than one engine step prefills: its seeded requests survive that.

Half the groups are multi-turn episodes (``tests/helpers/episodes.py``: the same actor runs both built-in
workflows): each episode is the chat template's rendering of its conversation, the learner's response mask is the
episode's loss mask (the environment's tokens untrained), the log-probs of every model turn — sampled after the
environment's tokens — equal a transformers forward over the whole episode, and the reward worker's replay of the
environment accepts every episode. One row each is served by the adapters of ``asyncrl[envs]``: a skyrl-gym and a
TextArena environment run episodes on the engine's turns (their replays accept them), and reasoning-gym's rule scores a
single-turn answer.

The thinking model's template drops past reasoning once a later user turn follows, so its episodes are kept per turn
(``common/environments/turns.py``): each model turn was sampled on the context the template serves for the
conversation before it, and the learner's rows (``learner/update/batch.py: ServedRows``) hold exactly those contexts —
its log-probs on them equal vLLM's, and every model token is trained in exactly one row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.actors.episode_scoring import replay_episode
from asyncrl.actors.episodes import close_environment_hosts
from asyncrl.common.config import RunConfig
from asyncrl.common.data.gyms import verify_reasoning_gym
from asyncrl.common.data.prompts import Prompter, model_vocab_size
from asyncrl.common.data.tasks import TaskExample, get_task
from asyncrl.common.environments.turns import episode_tools, turn_text
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.rewards.response_text import ResponseTexts
from asyncrl.common.tiny_models.chat import ARCHITECTURES, IM_END, chat_examples, init_chat_model, warm_start_chat
from asyncrl.common.transport.channel import PullChannel
from asyncrl.common.wire.messages import Heartbeat, RolloutGroup, ScoredGroup, model_turns, segments
from asyncrl.learner.intake.batch_source import BatchSource
from asyncrl.learner.update.batch import collate
from tests.helpers.actor_stack import stop, transformers_logprobs
from tests.helpers.episodes import ADAPTERS, adapter_of, adapter_section, is_episode
from tests.helpers.rollouts import answer

ACTOR = str(Path(sys.executable).parent / "rl-actor")
ROOT = Path(__file__).resolve().parents[2]
LOGPROB_TOLERANCE = 1e-4
RUN = "chat"
GROUPS = 16


@pytest.fixture(scope="module", params=ARCHITECTURES)
def chat_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(architecture, folder): random weights, briefly warm-started on chat rows so some responses end their turn."""
    arch = request.param
    folder = init_chat_model(tmp_path_factory.mktemp(arch) / "model", arch, seed=0)
    rows = chat_examples(2000, seed=1)
    if arch == "qwen3":  # a thinking model that reasons and ends its turns under this test's system prompt, so that
        # later contexts drop earlier reasoning (4 steps on bare rows leave it ending no turn in some runs)
        system = {"role": "system", "content": SYSTEM_PROMPT}
        warm_start_chat(folder, [dict(row, messages=[system, *row["messages"]]) for row in rows], steps=40)
    else:
        warm_start_chat(folder, rows, steps=4)
    return arch, folder


@pytest.fixture(autouse=True, scope="module")
def _replays_hosts_end_with_the_module():
    """The replays' environments run in a process of this one (``environment.isolation``): ended here."""
    yield
    close_environment_hosts()


SYSTEM_PROMPT = "You are a careful assistant. Add the two numbers and reply with the sum only, nothing else."
"""Makes each prompt about 80 tokens: 16 groups x 4 samples then need more than one engine step's default prefill
budget (2048 tokens), where vLLM would prefill some prompts in chunks — which its seeded requests cannot survive on
CPUs (``actors.engine.whole_prompt_prefills``)."""


def run_config(tmp_path: Path, model_dir: Path, data: Path, groups: int = 16, samples: int = 4) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": {"name": RUN, "root": str(tmp_path / "runs")},
            "model": {"path": str(model_dir), "max_model_len": 256},
            "task": {
                "name": "file",
                "path": str(data),
                "options": {"verifier": "arithmetic"},
                "system_prompt": SYSTEM_PROMPT,
            },
            # the engine's layout is not what these tests check: the one that starts fastest (its worker inside the
            # engine core, pinned to CPU 0; tests/integration/actors/test_rollout_actor.py checks both layouts)
            "rollout": {
                "num_samples": samples,
                "max_new_tokens": 24,
                "kv_cache_bytes": 64 * 2**20,
                "cpu_single_process": True,
                "cpu_threads": "0",
                "workflow": "tests.helpers.episodes:alternate",
            },
            "environment": {"name": "tests.helpers.episodes:Prodding", "max_turns": 3, "max_episode_tokens": 160},
            "learner": {"groups_per_step": groups, "wait_for_batch_s": 30},
            "staleness": {"max_staleness": 0},
            "transport": {"heartbeat_s": 0.5, "heartbeat_ttl_s": 5},
        }
    )


def test_the_folders_load_as_users_models_do(chat_model: tuple[str, Path]) -> None:
    """The chat template is read from tokenizer_config.json; special tokens come once (the Llama template writes
    BOS itself); every character encodes (byte level); Qwen2's embedding is padded beyond its tokenizer."""
    arch, folder = chat_model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == tokenizer.chat_template
    prompter = Prompter.for_tokenizer(tokenizer, RunConfig().task)  # chat = "auto": the tokenizer has a template
    example = TaskExample("", "7", ({"role": "user", "content": "Wie viel ist 3+4? Café, déjà vu!"},))
    ids = prompter.encode(prompter.text(example))
    assert ids == tokenizer.apply_chat_template(list(example.messages), add_generation_prompt=True)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids).count("<|im_start|>") == 2  # the user turn and the generation prompt
    if arch == "llama":
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert prompter.stop_ids == ()  # its EOS is <|im_end|>: vLLM stops there by itself
    else:
        assert tokenizer.bos_token_id is None and prompter.stop_ids == (tokenizer.convert_tokens_to_ids(IM_END),)
        assert model_vocab_size(folder) > len(tokenizer)  # 640 embedding rows for 512 tokens
    assert prompter.unknown("?é€") == ""
    config = AutoModelForCausalLM.from_pretrained(folder).config
    assert config.vocab_size == model_vocab_size(folder) and config.tie_word_embeddings == (arch != "llama")


def start_actor(url: str) -> subprocess.Popen:
    """``rl-actor``, with the repository importable: the run's workflow and environment are in tests/helpers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([ACTOR, "--redis", url, "--run", RUN, "--id", "a1"], env=env)


def collect(pull: PullChannel, n: int, actor: subprocess.Popen, timeout_s: float = 400) -> list[RolloutGroup]:
    got: list[RolloutGroup] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline and actor.poll() is None, f"only {len(got)} of {n} rollout groups arrived"
        if (group := pull.recv(timeout_s=1.0)) is not None:
            got.append(group)
    return got


def test_the_learner_trains_exactly_the_ids_the_actor_generated(
    chat_model: tuple[str, Path], tmp_path: Path, redis_server, redis_client
) -> None:
    arch, folder = chat_model
    rows = chat_examples(GROUPS - len(ADAPTER_ROWS), seed=7) + adapter_rows(GROUPS - len(ADAPTER_ROWS))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = run_config(tmp_path, folder, data)
    plane = ControlPlane(redis_client, RUN)
    plane.run.publish_config(config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    source = BatchSource(config, plane, tokenizer, newest_version=0)
    assert source.dispatcher.release(0) == GROUPS  # all in flight at once: rollout.max_groups_in_flight is 16
    issued = {gid: plane.prompts.load_group(gid) for gid in plane.prompts.ledger()}
    prompter = Prompter.for_tokenizer(tokenizer, config.task)
    for group in issued.values():  # made once, by the dispatcher: the row's messages through the chat template
        row = rows[json.loads(group.extra)["id"]]
        expected = prompter.encode(prompter.text(TaskExample("", row["answer"], tuple(row["messages"]))))
        assert group.prompt_ids.tolist() == expected and group.prompt.endswith("<|im_start|>assistant\n")

    pull = PullChannel("rollouts", RolloutGroup, seal=run_seal(plane.client, plane.keys, "rollouts"))
    endpoint = pull.bind("tcp://127.0.0.1:0")
    plane.registry.beat(Heartbeat(process_id="collector", kind="reward", state="ready", endpoint=endpoint), 3600)
    actor = start_actor(redis_server.url)
    try:
        rollouts = collect(pull, GROUPS, actor)
    finally:
        assert stop(actor) == 0
        pull.close()

    texts = ResponseTexts(tokenizer)  # as a reward worker does: what is scored is the decode of the ids
    ReplayWriter(redis_client, plane.keys).add(
        [ScoredGroup(rollout=texts.rewrite(r)[0], rewards=np.arange(r.num_samples, dtype=np.float32)) for r in rollouts]
    )
    taken = source.take(0, threading.Event(), on_wait=lambda: None)
    assert taken.verdicts["refused"] == 0 and len(taken.entries) == GROUPS
    pad = tokenizer.pad_token_id
    batch = collate(taken.groups, pad)
    by_id = {r.group_id: r for r in rollouts}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    end_of_turn = tokenizer.convert_tokens_to_ids(IM_END)
    row, worst, tokens, ended, turns, rows_per_episode, reasoning_dropped = 0, 0.0, 0, 0, [], [], 0
    adapters: dict[str, list] = {name: [] for name in ADAPTER_ROWS}
    for group in taken.groups:
        sent = by_id[group.rollout.group_id]
        assert np.array_equal(sent.prompt_ids, issued[sent.group_id].prompt_ids)
        for i in range(sent.num_samples):
            ids, logprobs, _ = sent.response(i)
            trained = sent.trained(i)
            whole = np.concatenate([sent.prompt_ids, ids])
            assert batch.input_ids[row, : len(whole)].tolist() == whole.tolist()  # the very ids, no re-encoding
            assert batch.response_mask[row, len(sent.prompt_ids) : len(whole)].tolist() == trained.tolist()
            assert int(batch.response_mask[row].sum()) == int(trained.sum())
            adapter = adapter_of(sent)
            if adapter in ADAPTERS:  # the reward worker's replay through the adapter takes the episode
                section = adapter_section(config.environment, adapter)
                reward = asyncio.run(replay_episode(episode_tools(config.model.path), section, sent, i))
                adapters[adapter].append((model_turns(trained), reward))
            elif adapter:  # reasoning-gym's rows are single-turn, scored by the dataset's own rule
                assert trained.all()
                adapters[adapter].append(
                    verify_reasoning_gym(sent.texts[i], rows[json.loads(sent.extra)["id"]]["answer"])
                )
            elif is_episode(sent) and arch == "qwen3":
                made, dropped = check_served_episode(config, tokenizer, rows[json.loads(sent.extra)["id"]], sent, i)
                turns.append(made)
                reasoning_dropped += dropped
            elif is_episode(sent):
                turns.append(check_episode(config, tokenizer, rows[json.loads(sent.extra)["id"]], sent, i))
            else:
                assert trained.all()
            if sent.finish_reasons[i] == "stop":  # the template's end of turn is sampled, kept and trained on
                # ... or the model's EOS: Qwen2's is <|endoftext|>, not the end of turn, and vLLM stops there too
                assert ids[-1] in (end_of_turn, tokenizer.eos_token_id) and IM_END not in sent.texts[i]
                ended += int(ids[-1] == end_of_turn)
            for start, end in sent.rows(i):  # the whole episode, or (kept per turn) each of its rows: every turn
                expected = transformers_logprobs(model, sent.prompt_ids, ids[start:end])
                gap = np.abs(expected - logprobs[start:end])[trained[start:end]]
                worst = max(worst, float(gap.max(initial=0.0)))
            rows_per_episode.append(len(sent.rows(i)))
            tokens += int(trained.sum())
            row += 1
    padded = int(sum((r.token_ids >= len(tokenizer)).sum() for r in rollouts))
    print(
        f"{arch}: vLLM vs transformers max |logprob diff| = {worst:.2e} over {tokens} sampled tokens; "
        f"{ended}/{row} responses ended their turn; {padded} padded ids sampled; model turns per episode: "
        f"{ {n: turns.count(n) for n in sorted(set(turns))} }; adapters (model turns, reward): {adapters}"
    )
    assert all(len(adapters[name]) == config.rollout.num_samples for name in ADAPTER_ROWS), adapters
    assert all(0.0 <= score <= 1.0 for score in adapters["reasoning_gym"])
    assert worst <= LOGPROB_TOLERANCE
    assert ended > 0, "no response ended its turn: the stop token is not honoured"
    assert max(turns) >= 2, "no episode went past its first turn"
    check_rows(batch, taken.groups, per_turn=arch == "qwen3")
    assert arch != "qwen3" or reasoning_dropped > 0, "no served context dropped a turn's reasoning"
    counts = {n: rows_per_episode.count(n) for n in sorted(set(rows_per_episode))}
    print(f"{arch}: training rows per response: {counts}; turns whose reasoning a later context dropped: "
          f"{reasoning_dropped}")  # fmt: skip


def check_rows(batch, groups: list[ScoredGroup], per_turn: bool) -> None:
    """The rows the learner's model runs on: with a thinking model, more rows than responses (its episodes kept per
    turn), each prompt + one row of a response, every trained token of the batch in exactly one of them."""
    if not per_turn:
        assert batch.served is None  # templates that append: one sequence per response
        return
    served = batch.served
    assert served is not None and served.input_ids.shape[0] > batch.rows, "no episode was kept per turn"
    sources = served.source[served.source >= 0]
    assert len(sources) == len(set(sources.tolist())) == int(batch.response_mask.sum())
    r = 0
    for group in groups:
        for i in range(group.rollout.num_samples):
            ids = group.rollout.response(i)[0]
            for start, end in group.rollout.rows(i):
                whole = np.concatenate([group.rollout.prompt_ids, ids[start:end]]).tolist()
                assert served.input_ids[r, : len(whole)].tolist() == whole
                assert int(served.attention_mask[r].sum()) == len(whole)
                r += 1
    assert r == served.input_ids.shape[0]


ADAPTER_ROWS = ("skyrl_gym", "textarena", "reasoning_gym")


def adapter_rows(first_id: int) -> list[dict]:
    """One row for each adapter (``asyncrl[envs]``): a GSM8K-style question for skyrl-gym's ``gsm8k_multi_turn``, a
    seeded TextArena game (its opening shortened to fit the context: the game is made from the answer's seed), and a
    reasoning-gym question with its dataset key."""
    game = get_task("textarena", game="GuessTheNumber-v0", seeds=100).sample(random.Random(1))
    few = {"min_animals": 1, "max_animals": 2}
    legs = get_task("reasoning_gym", dataset="leg_counting", size=50, config=few).sample(random.Random(0))
    prompts = {
        "skyrl_gym": ("What is 6+7?", "13"),  # as the warm start asked: some turns end, and skyrl-gym answers
        "textarena": ("Guess the number between 1 and 20, as [N].", game.answer),
        "reasoning_gym": (legs.prompt, legs.answer),
    }
    return [
        {"messages": [{"role": "user", "content": prompt}], "answer": answer, "id": first_id + n, "adapter": name}
        for n, (name, (prompt, answer)) in enumerate(prompts.items())
    ]


def check_episode(config: RunConfig, tokenizer, row: dict, sent: RolloutGroup, i: int) -> int:
    """Episode ``i`` of ``sent`` is the chat template's rendering of its conversation (the row's messages, then the
    model's turns and the environment's), and the reward worker's replay of the environment takes it: its reward is
    the turns the environment answered. Returns its model turns."""
    ids, _, _ = sent.response(i)
    parts = segments(sent.trained(i))
    tools = episode_tools(config.model.path)
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, *row["messages"]]
    for n, (start, end, trained) in enumerate(parts):
        if trained:  # the turn as sampled, special tokens and all (a random model samples <|im_start|> too)
            said = ids[start:end].tolist()
            said = said[:-1] if said[-1] == tools.end_id else said
            conversation.append({"role": "assistant", "content": tokenizer.decode(said)})
        else:  # Prodding's n-th question (tests/helpers/episodes.py)
            conversation.append({"role": "user", "content": f"Are you sure? Say it again ({n // 2 + 1})."})
    decoded = tokenizer.decode(np.concatenate([sent.prompt_ids, ids]).tolist())
    last_turn_ended = parts[-1][2] and ids[-1] == tools.end_id
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=not parts[-1][2])
    closing = "\n" if last_turn_ended else IM_END + "\n" if parts[-1][2] else ""  # what the episode stopped before
    assert decoded + closing == rendered
    model_turns = [ids[end - 1] for start, end, trained in parts if trained]
    reward = asyncio.run(replay_episode(tools, config.environment, sent, i))
    assert reward == sum(last == tools.end_id for last in model_turns)
    return len(model_turns)


def check_served_episode(config: RunConfig, tokenizer, row: dict, sent: RolloutGroup, i: int) -> tuple[int, int]:
    """Episode ``i`` of ``sent``, kept per turn: each model turn was sampled on the chat template's rendering of the
    conversation before it (the row's tokens before the turn, after the prompt) — the model's earlier turns as their
    text, their reasoning dropped by the template — and the reward worker's replay takes it. Returns its model
    turns, and how many of them reasoned and had a turn after them (whose context dropped that reasoning)."""
    ids, _, _ = sent.response(i)
    tools = episode_tools(config.model.path)
    assert tools.per_turn
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, *row["messages"]]
    turns, ended, reasoned = 0, 0, []
    for start, end in sent.rows(i):
        for first, last, by_model in segments(sent.trained(i)[start:end]):
            if not by_model:
                continue
            context = np.concatenate([sent.prompt_ids, ids[start : start + first]]).tolist()
            served = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(context) == served
            turns += 1
            said = turn_text(tokenizer, ids[start + first : start + last].tolist())
            ended += int(ids[start + last - 1] == tools.end_id)
            reasoned.append("</think>" in said)
            asked = f"Are you sure? Say it again ({turns})."
            conversation += [{"role": "assistant", "content": said}, {"role": "user", "content": asked}]
    reward = asyncio.run(replay_episode(tools, config.environment, sent, i))
    assert reward == ended  # Prodding scores the turns it was answered: those that ended
    return turns, sum(reasoned[:-1])


def test_a_group_that_sampled_a_padded_id_is_trained_not_dead_lettered(tmp_path: Path, redis_client) -> None:
    """Ids are checked against the model's embedding rows (config.vocab_size), not the tokenizer's length:
    an id in the padding (Qwen2.5: 151,936 rows for 151,665 tokens) is a real sample vLLM can draw."""
    folder = init_chat_model(tmp_path / "padded", "qwen2", vocab_size=300, padded_vocab=384, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 300 and model_vocab_size(folder) == 384
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in chat_examples(4)))
    config = run_config(tmp_path, folder, data, groups=1, samples=2)
    plane = ControlPlane(redis_client, RUN)
    source = BatchSource(config, plane, tokenizer, newest_version=0)
    assert source.dispatcher.release(0) == 1
    issued = plane.prompts.load_group(next(iter(plane.prompts.ledger())))
    padded_id = 350  # beyond the tokenizer, inside the embedding
    group = answer(issued, token_ids=np.array([5, padded_id, 7, padded_id, 2], np.int32), extra=issued.extra)
    rollout, _ = ResponseTexts(tokenizer).rewrite(group.rollout)  # an id beyond the tokenizer decodes to nothing
    group = dataclasses.replace(group, rollout=rollout)
    ReplayWriter(redis_client, plane.keys).add([group])
    taken = source.take(0, threading.Event(), on_wait=lambda: None)
    assert [e.group.rollout.group_id for e in taken.entries] == [issued.group_id]
    assert redis_client.xlen(plane.keys.dead) == 0
    assert padded_id in collate(taken.groups, tokenizer.pad_token_id).input_ids.tolist()[0]
