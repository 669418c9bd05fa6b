"""Health alerts on synthetic metric streams: the exact step each alert fires at, and its numbers."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from reinforge.settings import AlertConfig
from reinforge.telemetry.alerts import Alert, AlertLog, AlertMonitor


def run(stream: list[dict], cfg: AlertConfig | None = None, first_step: int = 1) -> list[Alert]:
    """Feed `stream[i]` as step first_step + i; all alerts, in order."""
    monitor = AlertMonitor(cfg or AlertConfig(window=3))
    return [a for i, metrics in enumerate(stream) for a in monitor.check(first_step + i, metrics)]


def series(key: str, values: list) -> list[dict]:
    return [{key: v} for v in values]


# --- entropy collapse (window 3, ratio 0.1) ---------------------------------

def test_entropy_collapse_fires_when_the_window_mean_drops_below_ratio_x_baseline() -> None:
    # Baseline: mean(1.0, 0.9, 0.8) = 0.9, threshold 0.09. Current window means:
    # step 4: (0.9+0.8+0.05)/3 = 0.583, step 5: (0.8+0.05+0.05)/3 = 0.3, step 6: 0.05 < 0.09.
    alerts = run(series("entropy", [1.0, 0.9, 0.8, 0.05, 0.05, 0.05]))
    assert [(a.step, a.name) for a in alerts] == [(6, "entropy_collapse")]
    assert alerts[0].values == pytest.approx({"entropy": 0.05, "baseline": 0.9, "ratio": 0.1})
    assert alerts[0].message.startswith("step 6: entropy 0.05 is below 0.1 x its baseline 0.9 (entropy collapse")


def test_entropy_just_above_the_threshold_does_not_fire() -> None:
    # Baseline 1.0, threshold 0.1; the current mean settles at 0.1001.
    assert run(series("entropy", [1.0, 1.0, 1.0] + [0.1001] * 10)) == []
    # Exactly at the threshold is not below it either.
    assert run(series("entropy", [1.0, 1.0, 1.0] + [0.1] * 10)) == []


def test_entropy_collapse_fires_once_and_again_after_it_clears() -> None:
    low, high = 0.05, 1.0
    stream = [1.0, 0.9, 0.8, low, low, low, low, low, low,   # fires at 6, holds through 9
              high,                                          # step 10: (0.05+0.05+1)/3 = 0.37: clears
              0.01, 0.01, 0.01]                              # step 13: (0.01 x 3) < 0.09: fires again
    alerts = run(series("entropy", stream))
    assert [a.step for a in alerts] == [6, 13]
    assert alerts[1].values["entropy"] == pytest.approx(0.01)


# --- length blow-up (window 3, ratio 3, truncation_rate_max 0.5) ------------

def test_length_blowup_fires_when_the_window_mean_exceeds_ratio_x_baseline() -> None:
    # Baseline 10, threshold 30. Step 4: (10+10+40)/3 = 20, step 5: (10+40+40)/3 = 30 (not above), step 6: 40.
    alerts = run(series("response_length_mean", [10, 10, 10, 40, 40, 40, 40]))
    assert [(a.step, a.name) for a in alerts] == [(6, "length_blowup")]
    assert alerts[0].values == pytest.approx({"response_length_mean": 40.0, "baseline": 10.0, "ratio": 3.0})
    assert "mean response length 40 is above 3 x its baseline 10" in alerts[0].message
    assert "truncation" not in alerts[0].message


def test_length_just_under_the_threshold_does_not_fire() -> None:
    assert run(series("response_length_mean", [10, 10, 10] + [29.99] * 10)) == []


def test_truncation_rate_fires_length_blowup_and_says_so() -> None:
    # Window means of the truncation rate: step 3: (0.2+0.4+0.6)/3 = 0.4, step 4: (0.4+0.6+0.6)/3 = 0.533 > 0.5.
    stream = [{"response_length_mean": 10, "truncation_rate": r} for r in (0.2, 0.4, 0.6, 0.6)]
    alerts = run(stream)
    assert [(a.step, a.name) for a in alerts] == [(4, "length_blowup")]
    assert alerts[0].values["truncation_rate"] == pytest.approx(1.6 / 3)
    assert "truncation rate 0.533 is above 0.5" in alerts[0].message
    assert "mean response length" not in alerts[0].message


def test_truncation_rate_just_under_the_maximum_does_not_fire() -> None:
    assert run(series("truncation_rate", [0.49] * 10)) == []


def test_length_blowup_is_one_alert_for_both_reasons() -> None:
    stream = [{"response_length_mean": 10, "truncation_rate": 0.0}] * 3 + [
        {"response_length_mean": 100, "truncation_rate": 1.0}
    ] * 5
    alerts = run(stream)
    # Step 4: length (10+10+100)/3 = 40 > 30 and truncation 1/3 <= 0.5; step 5: truncation 2/3 > 0.5, still one alert.
    assert [a.step for a in alerts] == [4]
    assert "truncation" not in alerts[0].message
    # Both at once: length (10+10+100)/3 = 40 > 30 and truncation (0.4+0.4+1)/3 = 0.6 > 0.5 at step 4.
    both = run(
        [{"response_length_mean": 10, "truncation_rate": 0.4}] * 3
        + [{"response_length_mean": 100, "truncation_rate": 1.0}] * 3
    )
    assert [a.step for a in both] == [4]
    assert (
        "mean response length 40 is above 3 x its baseline 10 and truncation rate 0.6 is above 0.5" in both[0].message
    )


def test_length_blowup_refires_after_it_clears() -> None:
    alerts = run(series("truncation_rate", [0.9, 0.9, 0.9, 0.9, 0.0, 0.0, 0.9, 0.9, 0.9, 0.9]))
    # Fires at 3; step 5: (0.9+0.9+0)/3 = 0.6 holds; step 6: 0.3 clears; step 7: 0.3; step 8: 0.6 fires.
    assert [a.step for a in alerts] == [3, 8]


# --- reward hacking (window 2, hacking_eval_drop 0.05) ----------------------

HACKING = AlertConfig(window=2)


def hacking_stream(evals: dict[int, float], steps: int, reward=lambda s: s / 8) -> list[dict]:
    """reward_mean = reward(step) on steps 1..steps, eval/pass@1 on the steps in `evals`."""
    return [
        {"reward_mean": reward(s), **({"eval/pass@1": evals[s]} if s in evals else {})} for s in range(1, steps + 1)
    ]


def test_reward_hacking_fires_when_held_out_drops_while_train_reward_rises() -> None:
    # Rewards s/8. Eval at 4: 0.5 with reward mean (3/8+4/8)/2 = 0.4375; eval at 8: 0.45 (0.05 below)
    # with reward mean (7/8+8/8)/2 = 0.9375.
    alerts = run(hacking_stream({4: 0.5, 8: 0.45}, 10), HACKING)
    assert [(a.step, a.name) for a in alerts] == [(8, "reward_hacking")]
    assert alerts[0].values == pytest.approx({
        "eval/pass@1": 0.45, "best_eval/pass@1": 0.5, "best_eval_step": 4.0,
        "reward_mean": 0.9375, "best_eval_reward_mean": 0.4375,
    })
    assert alerts[0].message.startswith(
        "step 8: held-out pass@1 fell from 0.5 (step 4) to 0.45 while the mean train reward rose from 0.4375 to 0.9375"
    )


def test_reward_hacking_needs_both_the_drop_and_the_rise() -> None:
    assert run(hacking_stream({4: 0.5, 8: 0.4501}, 10), HACKING) == []                      # drop 0.0499
    assert run(hacking_stream({4: 0.5, 8: 0.3}, 10, reward=lambda s: -s / 8), HACKING) == []  # reward fell too
    assert run(hacking_stream({4: 0.5, 8: 0.3}, 10, reward=lambda s: 1.0), HACKING) == []     # reward flat


def test_reward_hacking_fires_once_and_again_after_a_new_best() -> None:
    evals = {4: 0.5, 8: 0.4, 12: 0.3,   # fires at 8; at 12 the condition still holds
             16: 0.6,                   # a new best: clears
             20: 0.5}                   # 0.1 below the best of step 16 with the reward higher: fires
    alerts = run(hacking_stream(evals, 20), HACKING)
    assert [a.step for a in alerts] == [8, 20]
    assert alerts[1].values["best_eval_step"] == 16
    assert alerts[1].values["best_eval/pass@1"] == 0.6


def test_reward_hacking_compares_with_the_best_not_the_previous_eval() -> None:
    # 0.5 at step 2, 0.47 at 4 (drop 0.03), 0.44 at 6 (0.06 below the best at step 2).
    alerts = run(hacking_stream({2: 0.5, 4: 0.47, 6: 0.44}, 6), HACKING)
    assert [a.step for a in alerts] == [6]
    assert alerts[0].values["best_eval_step"] == 2


def test_an_eval_before_the_first_train_step_compares_with_the_first_train_rewards() -> None:
    # Eval at step 0 has no train reward yet: its anchor is the first window (1/8+2/8)/2 = 0.1875.
    stream = [{"eval/pass@1": 0.5}] + hacking_stream({4: 0.4}, 4)
    alerts = run(stream, HACKING, first_step=0)
    assert [a.step for a in alerts] == [4]
    assert alerts[0].values["best_eval_reward_mean"] == pytest.approx(0.1875)
    assert alerts[0].values["reward_mean"] == pytest.approx(0.4375)


# --- exploding IS weights (is_weight_max 10) --------------------------------

def test_is_weight_explosion_fires_above_the_limit_once_per_episode() -> None:
    weights = [2.0, 9.99, 10.0, 10.5, 50.0, float("nan"), 80.0, 3.0, 12.0]
    alerts = run(series("is_weight_max", weights), AlertConfig())
    # 10.0 is not above 10; 10.5 at step 4 fires; 50 and 80 hold (NaN at 6 does not clear); 3 clears; 12 fires.
    assert [a.step for a in alerts] == [4, 9]
    assert alerts[0].values == {"is_weight_max": 10.5, "threshold": 10.0}
    assert alerts[0].message.startswith("step 4: largest IS weight pi_learner/pi_sampler 10.5 is above 10")


def test_infinite_is_weight_fires() -> None:
    assert [a.step for a in run(series("is_weight_max", [1.0, math.inf]))] == [2]


# --- common behaviour -------------------------------------------------------

def test_missing_none_and_nan_values_are_skipped() -> None:
    # Entropy's baseline is taken from the steps that have it (1, 3, 4): mean 1.0. Window means
    # over the values present: step 7: (1.0+0.05+0.05)/3 = 0.37; step 9: 0.05 < 0.1.
    stream = [{"entropy": 1.0}, {"entropy": None}, {"entropy": 1.0, "note": "text"}, {"entropy": 1.0, "flag": True},
              {}, {"entropy": float("nan")}, {"entropy": 0.05}, {"entropy": 0.05}, {"entropy": 0.05}]
    alerts = run(stream)
    assert [a.step for a in alerts] == [9]
    assert alerts[0].values["baseline"] == pytest.approx(1.0)


def test_a_step_without_the_metric_does_not_rearm_an_alert() -> None:
    alerts = run(series("is_weight_max", [20.0, None, 30.0]) + [{}] + series("is_weight_max", [40.0]), AlertConfig())
    assert [a.step for a in alerts] == [1]


def test_window_values_are_needed_before_anything_fires() -> None:
    # A truncation rate of 1 fires only once the window (3) is full.
    assert [a.step for a in run(series("truncation_rate", [1.0] * 5))] == [3]
    # Entropy falls to 0 at step 2, but the baseline (steps 1-3, mean 1/3) already includes it,
    # and the window mean 0 is reached at step 4 < 0.1 x 1/3: fires at 4, not before.
    assert [a.step for a in run(series("entropy", [1.0, 0.0, 0.0, 0.0]))] == [4]
    # With a window of 10 a 5-step stream never fires.
    assert run(series("entropy", [1.0, 0.0, 0.0, 0.0, 0.0]), AlertConfig(window=10)) == []


def test_disabled_monitor_never_fires() -> None:
    stream = series("is_weight_max", [100.0] * 3) + series("truncation_rate", [1.0] * 5)
    assert run(stream, AlertConfig(window=3)) != []
    assert run(stream, AlertConfig(window=3, enabled=False)) == []


def mixed_stream() -> list[dict]:
    """Every alert fires, clears and fires again; keys come and go."""
    stream = []
    for s in range(1, 41):
        metrics: dict = {"reward_mean": s / 40}
        metrics["entropy"] = 1.0 if s <= 5 or 16 <= s <= 20 else 0.01
        metrics["response_length_mean"] = 10.0 if s % 12 < 6 else 80.0
        if s % 7 != 0:
            metrics["truncation_rate"] = 0.6 if 25 <= s <= 30 else 0.1
        if s % 5 == 3:
            metrics["is_weight_max"] = 20.0 if s % 2 else 2.0
        if s % 4 == 0:
            metrics["eval/pass@1"] = 0.5 + 0.1 * ((s // 4) % 3 == 0) - 0.1 * ((s // 4) % 3 == 2)
        if s % 9 == 0:
            metrics["entropy"] = None
        stream.append(metrics)
    return stream


def test_mixed_stream_raises_every_alert_more_than_once() -> None:
    names = [a.name for a in run(mixed_stream())]
    for name in ("entropy_collapse", "length_blowup", "reward_hacking", "is_weight_explosion"):
        assert names.count(name) >= 2, (name, names)


@pytest.mark.parametrize("k", [0, 1, 3, 9, 17, 24, 33, 40])
def test_resumed_monitor_raises_the_alerts_of_an_uninterrupted_one(k: int) -> None:
    stream, cfg = mixed_stream(), AlertConfig(window=3)
    uninterrupted = run(stream, cfg)
    before = AlertMonitor(cfg)
    alerts = [a for s, m in enumerate(stream[:k], 1) for a in before.check(s, m)]
    after = AlertMonitor(cfg)
    after.load_state_dict(json.loads(json.dumps(before.state_dict())))
    alerts += [a for s, m in enumerate(stream[k:], k + 1) for a in after.check(s, m)]
    assert alerts == uninterrupted


# --- AlertLog ---------------------------------------------------------------

def test_alert_log_writes_json_lines_prints_and_truncates(tmp_path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=400, force_terminal=False)
    path = tmp_path / "alerts.jsonl"
    first = Alert(
        3, "is_weight_explosion", "step 3: weight [bold]inf[/bold]", {"is_weight_max": math.inf, "threshold": 10.0}
    )
    second = Alert(7, "entropy_collapse", "step 7: entropy 0.01", {"entropy": 0.01})

    log = AlertLog(path, console)
    assert log.position() == 0
    log.write([first])
    checkpoint = log.position()
    log.write([second])
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"step": 3, "alert": "is_weight_explosion", "message": "step 3: weight [bold]inf[/bold]",
         "values": {"is_weight_max": None, "threshold": 10.0}},
        second.to_json(),
    ]
    assert checkpoint == len(path.read_text().splitlines(keepends=True)[0].encode())
    # Markup in a message is printed literally.
    assert out.getvalue().splitlines() == ["step 3: weight [bold]inf[/bold]", "step 7: entropy 0.01"]

    # Resume from the checkpoint: the alert written after it is gone, new ones append.
    log = AlertLog(path, None, truncate_to=checkpoint)
    assert log.position() == checkpoint
    log.write([second])
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [3, 7]


def test_alert_to_json() -> None:
    alert = Alert(40, "entropy_collapse", "msg", {"entropy": 0.012})
    assert alert.to_json() == {"step": 40, "alert": "entropy_collapse", "message": "msg", "values": {"entropy": 0.012}}


# --- no gradient: steps in a row with nothing to train on (no_gradient_steps 3) ---------------

NO_GRADIENT = AlertConfig(window=3, no_gradient_steps=3)
CURATION_FIXES = (
    "(training on nothing: consider an easier task (task.options) or an SFT stage first (sft.enabled=true), "
    "a larger train.group_size, more refill rounds (curation.refill=dynamic or active, curation.max_rounds), "
    "or no filter (remove zero_variance from curation.filters))"
)


def kept(n: int, reward: float = 0.0) -> dict:
    """An RL step's curation figures: `n` prompts kept (0: every group dropped by the zero-variance filter)."""
    return {"curation/prompts_kept": n, "curation/dropped_zero_variance": 4 - n, "reward_mean": reward}


def test_no_gradient_fires_once_at_the_nth_empty_step_with_what_to_change() -> None:
    alerts = run([kept(0)] * 8, NO_GRADIENT)
    assert [(a.step, a.name) for a in alerts] == [(3, "no_gradient")]
    assert alerts[0].message == (
        "step 3: 3 steps in a row took no update: curation dropped every sampled group (filter zero_variance: "
        "each group's samples had identical rewards, so zero advantage; mean reward 0) " + CURATION_FIXES)
    assert alerts[0].values == {"steps": 3.0, "no_gradient_steps": 3.0, "reward_mean": 0.0}


def test_no_gradient_needs_n_empty_steps_in_a_row_and_rearms_after_an_update() -> None:
    # Empty, empty, update, then 4 empty: the streak restarts at step 4 and reaches 3 at step 6.
    # After another update (step 8) three more empty steps fire it again (step 11).
    stream = [kept(0), kept(0), kept(2), kept(0), kept(0), kept(0), kept(0), kept(4), kept(0), kept(0), kept(0)]
    assert [(a.step, a.name) for a in run(stream, NO_GRADIENT)] == [(6, "no_gradient"), (11, "no_gradient")]
    assert run([kept(0), kept(0), kept(1)] * 5, NO_GRADIENT) == []
    # Steps that report neither count (an evaluation) neither extend nor break the streak.
    assert [a.step for a in run([kept(0), {"eval/pass@1": 0.1}, kept(0), kept(0)], NO_GRADIENT)] == [4]


def test_no_gradient_for_dpo_and_for_all_correct_groups() -> None:
    dpo = run([{"dpo/pairs": 0, "reward_mean": 0.0}] * 3, NO_GRADIENT)
    assert dpo[0].message == (
        "step 3: 3 steps in a row took no update: no prompt gave a preference pair (each prompt's train.group_size "
        "samples were all correct or all wrong; mean reward 0) (training on nothing: consider an easier task "
        "(task.options) or an SFT stage first (sft.enabled=true), a larger train.group_size, or pairs from a file "
        "(dpo.pairs=dataset))")
    assert run([{"dpo/pairs": 0}, {"dpo/pairs": 2}, {"dpo/pairs": 0}, {"dpo/pairs": 0}], NO_GRADIENT) == []
    # Every sample right: the advice turns to a harder task.
    easy = run([kept(0, reward=1.0)] * 3, NO_GRADIENT)
    assert "mean reward 1) (training on nothing: consider a harder task (task.options), a larger" in easy[0].message


def test_no_gradient_streak_survives_a_resume() -> None:
    whole = run([kept(0)] * 5, NO_GRADIENT)
    first = AlertMonitor(NO_GRADIENT)
    assert [a for s in (1, 2) for a in first.check(s, kept(0))] == []
    second = AlertMonitor(NO_GRADIENT)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed = [a for s in (3, 4, 5) for a in second.check(s, kept(0))]
    assert resumed == whole and [a.step for a in resumed] == [3]
