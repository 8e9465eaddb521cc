"""samples.jsonl: the responses a person reads, picked from the batch trained on, with what the update saw."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from asyncrl.cli.top import render
from asyncrl.common.plane.replay import ReplayEntry
from asyncrl.common.wire.messages import ScoredGroup, segments
from asyncrl.learner.intake.batch_source import Taken
from asyncrl.learner.record.recorder import (
    ending_figures,
    episode_figures,
    group_stage_seconds,
    group_timelines,
    latency_figures,
    length_figures,
    tool_call_figures,
)
from asyncrl.learner.record.samples import MAX_TEXT, SampleLog, row_advantages
from tests.helpers.rollouts import make_group
from tests.helpers.scripted_episodes import CALL, episode, tools_for


def scored(texts: list[str], rewards: list[float], group_id: str) -> ScoredGroup:
    rollout = make_group(texts, group_id=group_id, finish_reasons=["stop"] * (len(texts) - 1) + ["length"])
    details = [{"task": r, "format": 1.0} for r in rewards]
    return ScoredGroup(rollout=rollout, rewards=np.array(rewards, np.float32), details=details)


def test_row_advantages_are_the_mean_over_each_responses_tokens() -> None:
    advantages = torch.tensor([[9.0, 1.0, 3.0, 0.0], [9.0, 9.0, -2.0, 0.0]])
    mask = torch.tensor([[False, True, True, False], [False, False, True, False]])
    got = row_advantages([("g", 0), ("g", 1)], advantages, mask)
    assert got == {("g", 0): 2.0, ("g", 1): -2.0}  # (1 + 3) / 2 ; -2 / 1 — prompt and padding ignored


def test_rows_hold_random_picks_then_the_worst_and_the_best(tmp_path) -> None:
    groups = [
        scored(["19", "18", "x"], [1.0, 0.0, 0.0], "a"),
        scored(["19", "20", "1900"], [0.5, 0.25, 0.0], "b"),
    ]
    advantages = {("a", 0): 0.9, ("b", 2): -0.4}
    log = SampleLog(tmp_path / "samples.jsonl", every=2, per_step=2, seed=0)
    assert not log.write(3, groups, advantages) and not (tmp_path / "samples.jsonl").exists()
    rows = log.write(4, groups, advantages)
    assert [r["pick"] for r in rows] == ["random", "random", "worst", "best"]
    worst, best = rows[2], rows[3]
    assert (worst["group_id"], worst["response_index"], worst["reward"]) == ("a", 1, 0.0)  # the first lowest
    assert (best["group_id"], best["response_index"], best["response"], best["advantage"]) == ("a", 0, "19", 0.9)
    assert best["details"] == {"task": 1.0, "format": 1.0} and best["prompt"] == "12+7="
    assert {(r["group_id"], r["response_index"]) for r in rows[:2]}.isdisjoint({("a", 1), ("a", 0)})
    assert all(r["step"] == r["version"] == 4 and r["staleness"] == 3 for r in rows)  # 4 - 1 - version 0
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == rows
    assert log.rows(4, groups, advantages) == rows  # the picks are seeded by the run's seed and the step


def test_a_flat_step_has_one_row_for_worst_and_best_and_long_texts_are_cut(tmp_path) -> None:
    groups = [scored(["y" * (MAX_TEXT + 50), "z"], [0.0, 0.0], "c")]
    rows = SampleLog(tmp_path / "s.jsonl", every=1, per_step=5, seed=1).rows(1, groups, {})
    assert [r["pick"] for r in rows] == ["random", "worst"]  # worst and best are the same response
    assert len(rows[1]["response"]) == MAX_TEXT and rows[1]["advantage"] is None


def test_rl_top_shows_the_newest_worst_and_best() -> None:
    rows = SampleLog(None, every=1, per_step=0, seed=0).rows(7, [scored(["19", "no\nway"], [1.0, 0.0], "d")], {})
    queues = dict.fromkeys(["prompts", "inflight", "replay", "replay_pending", "dead_letters"], 0)
    snap = {"run": "r", "version": 7, "queues": queues, "processes": [], "lost": {}, "summary": None, "samples": rows}
    text = render(snap)
    assert "samples  step 7 (samples.jsonl)" in text
    assert "  worst reward 0.00 adv - length '12+7=' -> 'no\\nway'" in text
    assert "  best  reward 1.00 adv - stop   '12+7=' -> '19'" in text


def test_an_episodes_row_shows_its_turns_and_the_step_its_turn_counts(tmp_path) -> None:
    """A multi-turn episode in samples.jsonl: each turn with who wrote it (the tool call, then the tool's answer with
    the template's markers), the tokens trained; and the step's rollout/episode_* figures."""
    tools = tools_for("qwen2")
    rollout, _, _ = episode(tools, [CALL, "It is 42."])
    group = ScoredGroup(rollout=rollout, rewards=np.ones(1, np.float32))
    log = SampleLog(tmp_path / "samples.jsonl", every=1, per_step=0, seed=0)
    log.decode = tools.tokenizer.decode
    [row] = log.write(1, [group], {})
    assert [t["by"] for t in row["turns"]] == ["model", "environment", "model"]
    assert "<tool_call>" in row["turns"][0]["text"] and "<|im_start|>tool\n42<|im_end|>" in row["turns"][1]["text"]
    model_tokens = row["turns"][0]["tokens"] + row["turns"][2]["tokens"]
    assert row["trained_tokens"] == model_tokens == int(rollout.loss_mask.sum())
    plain = SampleLog(tmp_path / "plain.jsonl", every=1, per_step=0, seed=0).write(1, [scored(["1"], [1.0], "p")], {})
    assert "turns" not in plain[0]
    figures = episode_figures(Taken(entries=[ReplayEntry("1-0", group)]))
    assert figures["episode_turns_mean"] == figures["episode_turns_max"] == 2.0
    assert figures["episode_tokens_max"] == int(rollout.lengths[0])
    assert 0 < figures["episode_sampled_frac"] < 1
    endings = ending_figures(Taken(entries=[ReplayEntry("1-0", group)], faulted_episodes=3))
    assert endings["episode_endings/stop"] == 1.0 and endings["episode_endings/max_turns"] == 0.0
    assert (endings["faulted_episodes"], endings["env_error_frac"]) == (3.0, 0.75)  # 3 faulted, 1 trained
    figures |= endings
    calls = tool_call_figures(Taken(entries=[ReplayEntry("1-0", group)]), tools.tokenizer.decode)
    assert calls == {"episode_tool_calls_mean": 1.0, "episode_malformed_calls_mean": 0.0}
    assert tool_call_figures(Taken(entries=[ReplayEntry("1-0", group)]), None) == {}
    figures |= calls
    # rl-top: episodes in flight (K per group in flight) and the step's episode figures.
    queues = {**dict.fromkeys(["prompts", "replay", "replay_pending", "dead_letters"], 0), "inflight": 3}
    summary = {"step": 1, **{f"rollout/{key}": value for key, value in figures.items()}}
    snap = {"run": "r", "version": 1, "queues": queues, "processes": [], "lost": {}, "summary": summary}
    text = render({**snap, "samples": [row], "episodes_per_group": 8})
    assert "in flight     3 (24 episodes)" in text
    assert "episodes: turns 2.0 (max 2)" in text and "sampled by the model" in text
    assert "tool calls 1.00 per episode (0.00 malformed)" in text
    assert "ended by a limit 0% (tokens 0%, turns 0%, time 0%)   environment faults 3 episodes (75.0%" in text


def test_a_steps_lengths_cover_every_response_its_truncations_and_its_prompts(tmp_path) -> None:
    """Response tokens (mean, p50, p95, max) over every response of the step, the share cut by a token limit, prompt
    tokens per group; for episodes the model's turns too. rl-top shows them on a line of their own."""
    a, b = scored(["19", "18", "x"], [1.0, 0.0, 0.0], "a"), scored(["19", "1900"], [0.5, 0.0], "b")
    lengths = np.concatenate([a.rollout.lengths, b.rollout.lengths]).astype(float)
    figures = length_figures(Taken(entries=[ReplayEntry("1-0", a), ReplayEntry("1-1", b)]))
    assert figures["response_tokens_mean"] == pytest.approx(lengths.mean())
    assert figures["response_tokens_p50"] == np.percentile(lengths, 50)
    assert figures["response_tokens_p95"] == np.percentile(lengths, 95)
    assert figures["response_tokens_max"] == lengths.max()
    assert figures["truncated_frac"] == pytest.approx(2 / 5)  # the last response of each group ends on "length"
    assert figures["prompt_tokens_max"] == max(len(a.rollout.prompt_ids), len(b.rollout.prompt_ids))
    assert "turn_tokens_mean" not in figures  # no episode in the step
    tools = tools_for("qwen2")
    rollout, _, _ = episode(tools, [CALL, "It is 42."])
    group = ScoredGroup(rollout=rollout, rewards=np.ones(1, np.float32))
    episodes = length_figures(Taken(entries=[ReplayEntry("1-0", group)]))
    turns = [end - start for start, end, trained in segments(rollout.trained(0)) if trained]
    assert (episodes["turn_tokens_mean"], episodes["turn_tokens_max"]) == (np.mean(turns), max(turns))
    summary = {"step": 1, **{f"rollout/{key}": value for key, value in figures.items()}}
    queues = dict.fromkeys(["prompts", "inflight", "replay", "replay_pending", "dead_letters"], 0)
    text = render({"run": "r", "version": 1, "queues": queues, "processes": [], "lost": {}, "summary": summary})
    assert f"responses: tokens mean {lengths.mean():.1f}   p95" in text and "truncated 40%" in text


def test_a_steps_latency_splits_each_groups_time_from_issue_to_batch_into_its_stages() -> None:
    """Issued at 1 s, taken at 4 s, generated for 3 s, in the replay stream at 10 s (its id's milliseconds), the batch
    complete at 12 s: 3 s queued, 3 generating, 3 pushing and scoring, 2 waiting to be trained, 11 in all; a second
    group taken 2 s later: 5, 3, 1, 2. A group without an issue time or an actor's ``taken_at`` is left out."""
    import dataclasses

    timed = [
        dataclasses.replace(g.rollout, timings={"generate": 3.0, "taken_at": 4.0 + shift})
        for g, shift in ((scored(["19"], [1.0], "a"), 0.0), (scored(["19"], [1.0], "b"), 2.0))
    ]
    untimed = scored(["19"], [1.0], "c")
    taken = Taken(
        entries=[
            ReplayEntry("10000-0", ScoredGroup(rollout=timed[0], rewards=np.ones(1, np.float32))),
            ReplayEntry("10000-1", ScoredGroup(rollout=timed[1], rewards=np.ones(1, np.float32))),
            ReplayEntry("10500-0", untimed),
        ],
        issued_at={timed[0].group_id: 1.0, timed[1].group_id: 1.0, untimed.rollout.group_id: 1.0},
        complete_at=12.0,
    )
    timelines = group_timelines(taken)
    assert timelines[timed[0].group_id] == {
        "issued": 1.0, "taken": 4.0, "generated": 7.0, "stored": 10.0, "batch_complete": 12.0
    }  # fmt: skip
    stages = group_stage_seconds(timelines)
    assert stages.tolist() == [[3.0, 3.0, 3.0, 2.0], [5.0, 3.0, 1.0, 2.0]]
    figures = latency_figures(stages)
    assert figures == pytest.approx(
        {"queued_s": 4.0, "generate_s": 3.0, "scoring_s": 2.0, "replay_s": 2.0, "total_s": 11.0, "total_s_max": 11.0}
    )
    only_untimed = Taken(entries=[ReplayEntry("10500-0", untimed)], complete_at=12.0)
    assert latency_figures(group_stage_seconds(group_timelines(only_untimed))) == {}
    rows = SampleLog(None, every=1, per_step=5, seed=0).rows(1, [taken.entries[0].group, untimed], {}, timelines)
    assert {row["group_id"]: "timeline" in row for row in rows} == {
        timed[0].group_id: True,
        untimed.rollout.group_id: False,
    }
    summary = {"step": 1, **{f"latency/{key}": value for key, value in figures.items()}}
    queues = dict.fromkeys(["prompts", "inflight", "replay", "replay_pending", "dead_letters"], 0)
    text = render({"run": "r", "version": 1, "queues": queues, "processes": [], "lost": {}, "summary": summary})
    assert "group time: queued 4.00s   generate 3.00s   scoring 2.00s   replay 2.00s   total 11.00s" in text


def test_each_groups_stages_are_observed_in_the_stage_histograms() -> None:
    """Two groups, one observation each per stage and for the total: the histogram's count rises by 2 and its sum by
    the groups' seconds (the queued stage 3 + 5 s; the totals 11 + 11 s)."""
    from asyncrl.common.observability import metrics as m
    from asyncrl.learner.record.telemetry import observe_group_stages

    def count_and_sum(stage: str) -> tuple[float, float]:
        def value(suffix: str) -> float:
            name = f"asyncrl_learner_group_stage_duration_seconds_{suffix}"
            return m.REGISTRY.get_sample_value(name, {"stage": stage}) or 0.0

        return value("count"), value("sum")

    before = {stage: count_and_sum(stage) for stage in ("queued", "total")}
    observe_group_stages(np.asarray([[3.0, 3.0, 3.0, 2.0], [5.0, 3.0, 1.0, 2.0]]))
    for stage, added in (("queued", 8.0), ("total", 22.0)):
        count, total = count_and_sum(stage)
        assert (count - before[stage][0], total - before[stage][1]) == pytest.approx((2.0, added))
