"""Several domains in one run (task.name=mix): the splits' proportions and determinism, dispatch to
each domain's verifier and traces, reward functions restricted to domains, per-domain training and
held-out figures, and a short run that writes them. Expected numbers are derived in the comments."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from repo_paths import TESTS
from unit.eval.test_evaluate import ScriptedEngine
from unit.rewards.test_reward_composition import _close, _rollout

from reinforge.config import build_config
from reinforge.curation.batches import _weighted_mean
from reinforge.errors import ConfigError
from reinforge.eval.evaluate import EvalResult, evaluate
from reinforge.jobs.train import run
from reinforge.loops.rl import composed_scores
from reinforge.rewards.compose import RewardComposer
from reinforge.rewards.user import register
from reinforge.rollout import SamplingParams
from reinforge.settings import RewardConfig
from reinforge.tasks import Example, build_task
from reinforge.tasks.arithmetic import ArithmeticTask
from reinforge.tasks.countdown import CountdownTask
from reinforge.tasks.mix import MixTask, domain_schedule
from reinforge.telemetry.recorder import eval_metrics

MIX = [{"name": "arithmetic", "weight": 0.7, "options": {"digits": 2}}, {"name": "countdown", "weight": 0.3}]
MIX_OPTION = ("task.options.domains=[{name: arithmetic, weight: 0.7, options: {digits: 2}}, "
              "{name: countdown, weight: 0.3}]")

# Hand-built examples of each domain, tagged as the mix tags them.
ADD = Example("12+34=", "46", {"a": 12, "op": "+", "b": 34, "domain": "arithmetic"})
ADD2 = Example("20+05=", "25", {"a": 20, "op": "+", "b": 5, "domain": "arithmetic"})
COUNT = Example("3 5 7>36:", "36", {"numbers": [3, 5, 7], "target": 36, "domain": "countdown"})


def _mix(**options) -> MixTask:
    return build_task("mix", domains=MIX, **options)


def _untagged(e: Example) -> Example:
    return Example(e.prompt, e.answer, {k: v for k, v in e.meta.items() if k != "domain"})


# ------------------------------------------------------------------ splits


def test_schedule_follows_the_weights_slot_by_slot() -> None:
    # Slot i goes to the largest deficit (i + 1) p_d - c_d, ties to the first domain:
    # i=0: .7 vs .3 -> A; i=1: .4 vs .6 -> C; i=2: 1.1 vs -.1 -> A; i=3: .8 vs .2 -> A;
    # i=4: .5 vs .5 (tie) -> A; i=5: .2 vs .8 -> C; i=6: .9 vs .1 -> A; i=7: .6 vs .4 -> A;
    # i=8: .3 vs .7 -> C; i=9: 1.0 vs 0 -> A.
    assert domain_schedule([0.7, 0.3], 10) == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    assert domain_schedule([7, 3], 10) == domain_schedule([0.7, 0.3], 10)     # weights are normalised
    slots = domain_schedule([0.5, 0.3, 0.2], 1000)
    assert [slots.count(d) for d in range(3)] == [500, 300, 200]
    # never a whole slot ahead of its share, at any prefix
    for n in range(1, 1001):
        assert all(slots[:n].count(d) - n * p < 1 for d, p in enumerate([0.5, 0.3, 0.2]))


def test_splits_hold_the_domains_in_proportion_and_are_each_domains_own() -> None:
    mix = _mix(seed=3)
    train, held_out = mix.train_split(100), mix.eval_split(20)
    assert [e.meta["domain"] for e in train].count("arithmetic") == 70
    assert [e.meta["domain"] for e in held_out].count("countdown") == 6
    # Each domain's examples are what its own task draws with that seed, in order (same held-out membership).
    assert [_untagged(e) for e in train if e.meta["domain"] == "arithmetic"] == \
        ArithmeticTask(seed=3, digits=2).train_split(70)
    assert [_untagged(e) for e in held_out if e.meta["domain"] == "countdown"] == CountdownTask(seed=3).eval_split(6)
    assert not {e.prompt for e in train} & {e.prompt for e in mix.eval_split(200)}


def test_splits_are_deterministic_prefix_stable_and_order_free() -> None:
    a, b = _mix(), _mix()
    b_eval = b.eval_split(30)               # asked in the other order
    assert a.train_split(50) == b.train_split(50) and a.eval_split(30) == b_eval
    assert a.train_split(17) == a.train_split(50)[:17]
    assert _mix(seed=1).train_split(20) != a.train_split(20)


def test_a_file_domain_that_runs_out_leaves_its_slots_empty(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    mix = build_task("mix", domains=["arithmetic", {"name": "dataset", "options": {"path": str(rows),
                                                                                  "eval_path": str(rows)}}])
    # Weights 1:1 alternate A, D, A, D, ...; the file's train split has 3 rows, so its 4th and 5th slots are empty.
    assert [e.meta["domain"] for e in mix.train_split(10)] == ["arithmetic", "dataset"] * 3 + ["arithmetic"] * 2
    assert [e.prompt for e in mix.train_split(10) if e.meta["domain"] == "dataset"] == ["q0", "q1", "q2"]


def test_domains_renamed_and_refused() -> None:
    mix = build_task("mix", domains=[{"name": "arithmetic", "domain": "add2", "options": {"digits": 2}},
                                     {"name": "arithmetic", "domain": "add3"}])
    assert mix.domains == ("add2", "add3")
    assert {len(e.prompt) for e in mix.train_split(4)} == {6, 8}     # "12+34=" and "123+456="
    with pytest.raises(ValueError, match=r"domains\[1\]: domain 'arithmetic' is listed twice: name one of them "
                                         r"with task.options.domains\[1\].domain=NAME"):
        build_task("mix", domains=["arithmetic", "arithmetic"])
    with pytest.raises(ValueError, match=r"domains\[0\].name=mix: a mix cannot hold a mix"):
        build_task("mix", domains=["mix"])
    with pytest.raises(ValueError, match=r"domains\[1\].weight must be a number > 0, got 0"):
        build_task("mix", domains=["arithmetic", {"name": "countdown", "weight": 0}])


@pytest.mark.parametrize(("domains", "message"), [
    ("[{name: arithmetic, wieght: 2}]", "task.options.domains[0].wieght is not a key of a domain (valid: name, "
                                        "domain, weight, options)"),
    ("[arithmetic, {name: countdown, options: {digits: 2}}]",
     "task.options.domains[1].options.digits is an option of task.name=arithmetic or chain_sum or multiply_tool, "
     "not of the task 'countdown': set task.options.domains[1].name=arithmetic"),
    ("[arithmetic, dataset]", "task 'dataset' needs task.options.domains[1].options.path"),
    ("[arithmetc]", "task.options.domains[0].name must name a task"),
])
def test_config_names_the_domain_key_at_fault(domains: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(["task.name=mix", f"task.options.domains={domains}"])
    assert message in str(info.value)


# ------------------------------------------------------------------ dispatch


def test_each_example_is_verified_by_its_own_domain() -> None:
    mix = _mix()
    assert mix.reward(ADD, "46") == 1.0 and mix.reward(ADD, "47") == 0.0
    assert mix.reward(COUNT, "3*(5+7)") == 1.0
    assert mix.reward(COUNT, "36") == 0.0             # the countdown verifier wants an expression over the numbers
    assert mix.domain_of(COUNT) == "countdown"
    with pytest.raises(ValueError, match="not a domain of this mix"):
        mix.reward(_untagged(ADD), "46")
    rng = random.Random(0)
    for e in (ADD, COUNT):    # the domain's teacher is right, its corruption wrong
        assert mix.reward(e, mix.teacher_completion(e, rng)) == 1.0
        assert mix.reward(e, mix.corrupt_completion(e, rng)) == 0.0


def test_sft_traces_follow_the_weights_even_past_a_small_split() -> None:
    mix = build_task("mix", domains=[{"name": "arithmetic", "options": {"digits": 1}}, "countdown"])
    train_prompts = {e.prompt for e in mix.tasks["arithmetic"].train_split(80)}   # all the 1-digit train sums
    traces = mix.sft_examples(200, 0.5, seed=0)
    sums = [t for t in traces if "+" in t.prompt and ">" not in t.prompt]
    assert len(sums) == 100          # 80 problems cycled: still half the traces
    assert {t.prompt for t in sums} <= train_prompts
    assert traces == mix.sft_examples(200, 0.5, seed=0)
    # each trace is its own domain's teacher (right) or corruption (wrong), as labelled
    sizes = {"arithmetic": 80, "countdown": 100}
    drawn = {e.prompt: (task, e) for name, task in mix.tasks.items() for e in task.train_split(sizes[name])}
    assert all(task.reward(e, t.completion) == float(t.correct) for t in traces for task, e in [drawn[t.prompt]])


def test_system_message_and_tool_traces_reach_every_domain() -> None:
    from reinforge.data.chat import with_system

    domains = [{"name": "multiply_tool", "options": {"digits": 1}}, "arithmetic"]
    mix, plain = build_task("mix", domains=domains), build_task("mix", domains=domains)
    assert mix.tools == ("reinforge.tasks.multiply_tool:calculator",)
    mix.system, mix.use_tools = "Be brief.", True       # as the pipeline sets them (prompt.system, rollout.tools)
    assert [e.prompt for e in mix.train_split(2)] == [with_system(e.prompt, "Be brief.") for e in plain.train_split(2)]
    traces = mix.sft_examples(4, 0.0, seed=0)
    # multiply_tool's traces are conversations with the calculator; arithmetic has none: single completions
    assert [len(t.turns) for t in traces] == [3, 0, 3, 0]
    assert all(t.prompt == with_system(t.prompt.messages[-1]["content"], "Be brief.") for t in traces)


# ------------------------------------------------------------------ rewards restricted to domains

FORMAT = {"name": "format", "weight": 0.5, "params": {"pattern": "[0-9+*/()-]+", "mode": "fullmatch"}}
TEXTS = ["46", "4 6", "3*(5+7)", "3+5"]     # two samples of ADD, then two of COUNT


def test_a_restricted_function_is_not_applicable_elsewhere() -> None:
    rollout = _rollout(TEXTS, [2, 3, 7, 3])
    restricted = RewardComposer(RewardConfig(functions=[{"name": "verifier"}, {**FORMAT, "domains": ["countdown"]}]),
                                _mix(), 8).score([ADD, COUNT], rollout, group_size=2)
    # verifier [1, 0, 1, 0] ("3+5" = 8, not 36); format on the countdown rows only: [-, -, 1, 1]
    _close(restricted.parts["format"], [math.nan, math.nan, 1.0, 1.0])
    _close(restricted.total, [1.0, 0.0, 1.5, 0.5])
    assert restricted.valid.all() and not restricted.skipped.any()
    assert restricted.metrics()["reward/format_mean"] == 1.0
    # Unrestricted, "46" would have matched the format too: 1 + 0.5.
    everywhere = RewardComposer(RewardConfig(functions=[{"name": "verifier"}, FORMAT]), _mix(), 8).score(
        [ADD, COUNT], rollout, group_size=2)
    _close(everywhere.total, [1.5, 0.0, 1.5, 0.5])


def test_a_skip_counts_only_where_the_function_applies(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    skip = {"name": "reward_fixtures:skip_empty", "domains": ["countdown"]}
    cfg = RewardConfig(functions=[{"name": "verifier"}, skip])
    out = RewardComposer(cfg, _mix(), 8).score([ADD, COUNT], _rollout(["", "46", "", "3*(5+7)"], [1, 2, 1, 7]), 2)
    # skip_empty returns None on "": the countdown row 2 is skipped; the arithmetic row 0 is not its domain.
    assert out.skipped.tolist() == [False, False, True, False]
    _close(out.total, [0.0, 1.0, math.nan, 2.0])


def test_a_batched_function_sees_only_its_domains_rows() -> None:
    seen: list[dict] = []

    def lengths(completions, domain, **kwargs):
        seen.append({"completions": list(completions), "domain": list(domain)})
        return [float(len(c)) for c in completions]

    cfg = RewardConfig(functions=[{"name": "verifier"}, {"name": register(lengths), "domains": ["countdown"]}])
    out = RewardComposer(cfg, _mix(), 8).score([ADD, COUNT], _rollout(TEXTS, [2, 3, 7, 3]), group_size=2)
    assert seen == [{"completions": ["3*(5+7)", "3+5"], "domain": ["countdown", "countdown"]}]
    _close(out.parts["lengths"], [math.nan, math.nan, 7.0, 3.0])


def test_unknown_or_uncovered_domains_are_config_errors() -> None:
    base = ["task.name=mix", MIX_OPTION]
    with pytest.raises(ConfigError, match=r"reward.functions\[1\].domains: 'countdwn' is not a domain of this run; "
                                          r"did you mean 'countdown'\? its domains: arithmetic, countdown"):
        build_config([*base, "reward.functions=[verifier, {name: format, params: {pattern: x}, domains: [countdwn]}]"])
    with pytest.raises(ConfigError, match="domain 'countdown' has no reward function"):
        build_config([*base, "reward.functions=[{name: verifier, domains: [arithmetic]}]"])
    with pytest.raises(ConfigError, match="'countdown' is not a domain of this run; its domains: arithmetic"):
        build_config(["reward.functions=[verifier, {name: format, params: {pattern: x}, domains: [countdown]}]"])
    cfg = build_config([*base, "reward.functions=[{name: verifier, domains: [arithmetic]}, "
                               "{name: verifier, domains: [countdown]}]"])
    assert [f.domains for f in cfg.reward.functions] == [["arithmetic"], ["countdown"]]


# ------------------------------------------------------------------ per-domain figures


def test_training_figures_per_domain() -> None:
    composer = RewardComposer(RewardConfig(functions=[{"name": "verifier"}, {**FORMAT, "domains": ["countdown"]}]),
                              _mix(), 8)
    scores = composed_scores(composer, 2)([ADD, COUNT], _rollout(TEXTS, [2, 3, 7, 3]))
    figures = _weighted_mean(scores.weighted_metrics)
    # arithmetic rows: totals [1, 0], verifier [1, 0]; countdown rows: totals [1.5, 0.5], verifier [1, 0], format [1, 1]
    assert figures == {
        "reward/domain/arithmetic/total_mean": 0.5, "reward/domain/arithmetic/pass_rate": 0.5,
        "reward/domain/arithmetic/verifier_mean": 0.5,
        "reward/domain/countdown/total_mean": 1.0, "reward/domain/countdown/pass_rate": 0.5,
        "reward/domain/countdown/verifier_mean": 0.5, "reward/domain/countdown/format_mean": 1.0,
    }
    assert scores.metrics["reward/domain/arithmetic/frac"] == scores.metrics["reward/domain/countdown/frac"] == 0.5
    # Over two rounds each domain's mean weighs by its own rows: 2 arithmetic rows at 0.5 and 6 at 1.0 -> 7/8.
    rounds = _weighted_mean([(2, {"reward/domain/arithmetic/total_mean": 0.5}),
                             (6, {"reward/domain/arithmetic/total_mean": 1.0})])
    assert rounds["reward/domain/arithmetic/total_mean"] == pytest.approx(7 / 8)


def test_a_task_of_one_domain_adds_no_figures() -> None:
    composer = RewardComposer(RewardConfig(), ArithmeticTask(), 8)
    scores = composed_scores(composer, 2)([_untagged(ADD), _untagged(ADD2)], _rollout(["46", "0", "25", "25"], [2] * 4))
    assert scores.weighted_metrics == [] and not any("domain" in k for k in scores.metrics)


def test_held_out_figures_per_domain() -> None:
    a_wrong, c_wrong = "99", "3+5"
    engine = ScriptedEngine(
        sampled={ADD.prompt: ["46", a_wrong, a_wrong, a_wrong], ADD2.prompt: ["25"] * 4,
                 COUNT.prompt: ["3*(5+7)", "(5+7)*3", c_wrong, c_wrong]},
        greedy={ADD.prompt: a_wrong, ADD2.prompt: "25", COUNT.prompt: "3*(5+7)"},
    )
    result = evaluate(engine, _mix(), [ADD, COUNT, ADD2], num_samples=4, sampling=SamplingParams(), seed=0)
    # per prompt: 1/4, 2/4, 4/4 -> pass@1 (0.25 + 0.5 + 1) / 3; arithmetic (1 + 4) / 8, countdown 2 / 4
    assert result.pass_at_1 == pytest.approx(1.75 / 3)
    assert result.domains == {"arithmetic": {"pass@1": 0.625, "greedy_accuracy": 0.5, "num_prompts": 2},
                              "countdown": {"pass@1": 0.5, "greedy_accuracy": 1.0, "num_prompts": 1}}
    metrics = eval_metrics(result)
    assert metrics["eval/arithmetic/pass@1"] == 0.625 and metrics["eval/countdown/greedy_accuracy"] == 1.0
    assert EvalResult.from_summary(result.to_summary()) == result
    one = evaluate(engine, ArithmeticTask(), [_untagged(ADD)], num_samples=4, sampling=SamplingParams(), seed=0)
    assert "domains" not in one.to_summary() and not any(k.count("/") > 1 for k in eval_metrics(one))


@pytest.mark.slow
def test_a_mixed_run_writes_per_domain_figures(tmp_path: Path, micro_overrides) -> None:
    cfg = build_config([*micro_overrides, "task.name=mix", MIX_OPTION, "rollout.max_new_tokens=10",
                        "eval.num_prompts=10", "reward.functions=[verifier, {name: format, weight: 0.1, "
                        "params: {pattern: '[0-9+*/()-]+', mode: fullmatch}, domains: [countdown]}]",
                        f"output_dir={tmp_path / 'run'}"])
    summary = run(cfg).summary
    for end in ("start", "final"):
        evaluation = summary["eval"][end]
        # 10 held-out prompts at weights 0.7 / 0.3: 7 and 3; the whole is their prompt-weighted mean
        assert {d: f["num_prompts"] for d, f in evaluation["domains"].items()} == {"arithmetic": 7, "countdown": 3}
        assert evaluation["pass@1"] == pytest.approx(sum(f["pass@1"] * f["num_prompts"] / 10
                                                         for f in evaluation["domains"].values()))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r["stage"] == "eval"]
    assert [r["eval/countdown/pass@1"] for r in evals] == [summary["eval"]["start"]["domains"]["countdown"]["pass@1"],
                                                           summary["eval"]["final"]["domains"]["countdown"]["pass@1"]]
    rl = [r for r in lines if r["stage"] == "rl"]
    assert len(rl) == 3
    for r in rl:
        shares = r["reward/domain/arithmetic/frac"] + r["reward/domain/countdown/frac"]
        assert shares == pytest.approx(1.0)
        present = [d for d in ("arithmetic", "countdown") if r[f"reward/domain/{d}/frac"] > 0]
        assert all(math.isfinite(r[f"reward/domain/{d}/pass_rate"]) for d in present)
        assert "reward/domain/arithmetic/format_mean" not in r     # format scores countdown only
    assert torch.isfinite(torch.tensor([r["reward/total_mean"] for r in rl])).all()
