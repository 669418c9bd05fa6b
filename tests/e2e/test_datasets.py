"""File datasets: loaders and their errors, the dataset task's split and verifiers,
the shipped data sets, and short runs through the real pipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from reinforge.config import build_config
from reinforge.data import CODE_SMALL, MATH_SMALL, DatasetError, load_records, read_records
from reinforge.data.make_math import make_math, write_jsonl
from reinforge.errors import ConfigError
from reinforge.jobs.train import run
from reinforge.models.charset import CHARSET
from reinforge.tasks import build_task
from reinforge.verifiers.code import run_many

ROWS = [
    {"question": "What is 1/2 + 1/4?", "gold": "3/4", "level": 1},
    {"question": "What is 2 + 2?", "gold": 4, "level": 2},  # a numeric answer becomes "4"
    {"question": "Simplify sqrt(8).", "gold": "2*sqrt(2)", "level": 3},
]
FIELDS = {"prompt": "question", "answer": "gold"}
# The mapped fields under our names, and every column under its own name too (TRL / verl reward
# functions read the columns they know).
EXPECTED = [
    {"prompt": "What is 1/2 + 1/4?", "answer": "3/4", "level": 1, "question": "What is 1/2 + 1/4?", "gold": "3/4"},
    {"prompt": "What is 2 + 2?", "answer": "4", "level": 2, "question": "What is 2 + 2?", "gold": "4"},
    {
        "prompt": "Simplify sqrt(8).",
        "answer": "2*sqrt(2)",
        "level": 3,
        "question": "Simplify sqrt(8).",
        "gold": "2*sqrt(2)",
    },
]


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ----------------------------------------------------------------- loading


def test_jsonl_parquet_and_saved_datasets_load_the_same_records(tmp_path: Path) -> None:
    import datasets

    jsonl = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS] + [""])  # a trailing blank line is fine
    # Parquet columns have one type: the numeric gold is written as a string there.
    typed = [{**r, "gold": str(r["gold"])} for r in ROWS]
    datasets.Dataset.from_list(typed).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(typed).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(typed[:1]),
                          "test": datasets.Dataset.from_list(typed)}).save_to_disk(str(tmp_path / "dict"))

    assert load_records(jsonl, FIELDS) == [{**EXPECTED[0]}, {**EXPECTED[1], "gold": 4}, EXPECTED[2]]   # JSON keeps 4
    assert load_records(tmp_path / "d.parquet", FIELDS) == EXPECTED
    assert load_records(tmp_path / "saved", FIELDS) == EXPECTED
    assert load_records(f"{tmp_path / 'dict'}::test", FIELDS) == EXPECTED
    assert load_records(tmp_path / "dict", FIELDS, split="train") == EXPECTED[:1]
    with pytest.raises(DatasetError, match=r"several splits \(train, test\)"):
        load_records(tmp_path / "dict", FIELDS)
    with pytest.raises(DatasetError, match="no split 'valid'"):
        load_records(f"{tmp_path / 'dict'}::valid", FIELDS)
    # Unmapped columns keep their names; without a mapping the file's names are ours.
    assert load_records(jsonl, required=())[0] == ROWS[0]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"question": "a", "gold": "1"}', '{"question": "b", "gold": '], "line 2: bad JSON"),
        (
            ['{"question": "a", "gold": "1"}', "", '{"question": "b"}'],
            r"line 3: field 'answer' \(column 'gold'\) is missing",
        ),
        (['{"question": "  ", "gold": "1"}'], "line 1: empty prompt"),
        (['{"question": ["a"], "gold": "1"}'], "line 1: field 'prompt' must be str or a list of messages, got list"),
        (
            ['{"question": [{"role": "bot", "content": "a"}], "gold": "1"}'],
            "line 1: field 'prompt' holds messages, but message 0 has role 'bot'",
        ),
        (
            ['{"question": [{"role": "system", "content": "a"}], "gold": "1"}'],
            "line 1: field 'prompt' holds messages, but no user message with text",
        ),
        (['{"question": "a", "gold": null}'], r"line 1: field 'answer' \(column 'gold'\) is null"),
        (['["a", "1"]'], "line 1: expected an object"),
        (['[{"question": "a", "gold": "1"},'], "line 1: bad JSON.*not one JSON array"),
    ],
)
def test_a_bad_row_names_the_file_the_line_and_the_problem(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError, match=message) as err:
        load_records(path, FIELDS, required=["prompt", "answer"])
    assert str(path) in str(err.value)
    assert isinstance(err.value, ConfigError)  # the CLI prints it without a traceback


def test_parquet_rows_are_numbered_from_one(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list([{"question": "a", "gold": "1"}, {"question": "", "gold": "2"}]).to_parquet(
        str(tmp_path / "d.parquet"))
    with pytest.raises(DatasetError, match=r"d\.parquet', row 2: empty prompt"):
        load_records(tmp_path / "d.parquet", FIELDS)


def test_missing_file_unknown_extension_and_stray_split_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("prompt\nx\n")
    with pytest.raises(DatasetError, match=r"unknown data file extension '\.txt'"):
        load_records(tmp_path / "d.txt")
    with pytest.raises(DatasetError, match="only applies to a datasets folder"):
        load_records(f"{MATH_SMALL}::train")


def test_skip_invalid_skips_and_reports_every_bad_row(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "1"}', "{oops", '{"prompt": ""}',
                                               '{"prompt": "b", "answer": "2"}'])
    loaded = read_records(path, required=["prompt", "answer"], skip_invalid=True)
    assert [r["prompt"] for r in loaded.records] == ["a", "b"]
    assert loaded.locations == [f"'{path}', line 1", f"'{path}', line 4"]
    assert len(loaded.skipped) == 2 and "line 2: bad JSON" in loaded.skipped[0]
    task = build_task("dataset", path=str(path), eval_path=str(path), skip_invalid=True)
    assert task.skipped == {str(path): 2}
    with pytest.raises(DatasetError, match="line 2"):
        build_task("dataset", path=str(path), eval_path=str(path))


# ------------------------------------------------------------ dataset task


def test_hash_split_is_disjoint_complete_deterministic_and_ignores_template_and_seed() -> None:
    rows = load_records(MATH_SMALL)
    task = build_task("dataset", path=str(MATH_SMALL))
    train, held_out = task.train_split(len(rows)), task.eval_split(len(rows))
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in held_out)
    assert sorted(e.prompt for e in train + held_out) == sorted(r["prompt"] for r in rows)
    # Expected share 0.2 of 200: 40 +- 3 sd (binomial sd ~5.7), well inside [20, 60].
    assert 20 <= len(held_out) <= 60
    # File order within each split, and `n` takes a prefix.
    order = {r["prompt"]: i for i, r in enumerate(rows)}
    assert [order[e.prompt] for e in held_out] == sorted(order[e.prompt] for e in held_out)
    assert task.train_split(5) == train[:5]

    again = build_task("dataset", path=str(MATH_SMALL), seed=7, prompt_template="Q: {prompt}\nA:")
    assert [e.prompt for e in again.eval_split(len(rows))] == [f"Q: {e.prompt}\nA:" for e in held_out]
    assert again.eval_split(3)[0].meta == {"kind": held_out[0].meta["kind"]}


def test_eval_path_is_the_held_out_split_whole(tmp_path: Path) -> None:
    held = _write_jsonl(tmp_path / "held.jsonl", [json.dumps({"prompt": "x?", "answer": "1"})])
    task = build_task("dataset", path=str(MATH_SMALL), eval_path=str(held))
    assert len(task.train_split(1000)) == 200       # asking for more than a file holds gives the whole file
    assert [e.prompt for e in task.eval_split(10)] == ["x?"]


def test_prompt_template_fills_record_fields_and_leaves_other_braces(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+1?", "answer": "2", "topic": "sums"})])
    task = build_task("dataset", path=str(path), eval_path=str(path),
                      prompt_template="[{topic}] {prompt} Put it in boxed{}, {{literal}}.")
    assert task.eval_split(1)[0].prompt == "[sums] 1+1? Put it in boxed{}, {literal}."
    with pytest.raises(DatasetError, match="line 1: field 'level' is missing"):
        build_task("dataset", path=str(path), eval_path=str(path), prompt_template="{level}: {prompt}")


@pytest.mark.parametrize(
    ("verifier", "right", "wrong"),
    [("math", "so the answer is \\boxed{{{gold}}}", "\\boxed{{{gold}+1}}"),
     ("exact", " {gold}\n", "{gold}."),
     ("integer", "{gold}", "{gold}0")],
)
def test_verifiers_score_gold_one_and_wrong_zero_on_shipped_rows(verifier: str, right: str, wrong: str) -> None:
    task = build_task("dataset", path=str(MATH_SMALL), verifier=verifier)
    examples = task.train_split(1000) + task.eval_split(1000)
    if verifier == "integer":
        examples = [e for e in examples if e.meta["kind"] in ("word", "percent")]
    else:
        by_kind = {e.meta["kind"]: e for e in examples}      # one of each kind: fraction, sqrt, ...
        examples = list(by_kind.values())
        assert len(examples) == 5
    for e in examples:
        assert task.reward(e, right.format(gold=e.answer)) == 1.0, e
        assert task.reward(e, wrong.format(gold=e.answer)) == 0.0, e


def test_math_verifier_accepts_equivalent_forms() -> None:
    task = build_task("dataset", path=str(MATH_SMALL), eval_path=str(MATH_SMALL))
    rows = {e.answer: e for e in task.eval_split(200)}
    assert task.reward(rows["7/48"], "\\boxed{\\frac{7}{48}}") == 1.0
    assert task.reward(rows["6*sqrt(3)"], "\\boxed{\\sqrt{108}}") == 1.0
    assert task.reward(rows["6*sqrt(3)"], "answer: 6*sqrt(3)") == 1.0   # in the tokenizer's characters


def test_sft_needs_a_completion_field_and_never_corrupts() -> None:
    import random

    task = build_task("dataset", path=str(CODE_SMALL), verifier="code")
    example = task.train_split(1)[0]
    with pytest.raises(ConfigError, match="sft.enabled=false"):       # input to fix, from Python too
        task.teacher_completion(example, random.Random(0))
    mapped = build_task("dataset", path=str(CODE_SMALL), verifier="code", fields={"completion": "solution"})
    assert mapped.teacher_completion(mapped.train_split(1)[0], random.Random(0)).startswith("def add(")
    assert [s.correct for s in mapped.sft_examples(3, corrupt_fraction=0.0, seed=0)] == [True] * 3
    with pytest.raises(ConfigError, match="sft.corrupt_fraction=0"):
        mapped.corrupt_completion(example, random.Random(0))


def test_bad_options_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs task.options.path"):
        build_config(["task.name=dataset"])
    with pytest.raises(ValueError, match="unknown verifier 'maths'"):
        build_task("dataset", path=str(MATH_SMALL), verifier="maths")
    with pytest.raises(ValueError, match="must contain '{prompt}'"):
        build_task("dataset", path=str(MATH_SMALL), prompt_template="Q: {question}")
    broken = _write_jsonl(tmp_path / "c.jsonl", [json.dumps({"prompt": "p", "tests": "x = 1"})])
    with pytest.raises(DatasetError, match="line 1: tests contain no top-level assert"):
        build_task("dataset", path=str(broken), verifier="code")


# ---------------------------------------------------------- shipped data


def test_math_small_is_what_the_generator_writes(tmp_path: Path) -> None:
    write_jsonl(make_math(), tmp_path / "math.jsonl")
    assert (tmp_path / "math.jsonl").read_bytes() == MATH_SMALL.read_bytes()
    assert make_math(20, seed=1) != make_math(20, seed=0)


@pytest.mark.parametrize("path", [MATH_SMALL, CODE_SMALL], ids=["math", "code"])
def test_shipped_prompts_use_only_the_builtin_tokenizer_characters(path: Path) -> None:
    prompts = [r["prompt"] for r in load_records(path)]
    assert len(prompts) == len(set(prompts))
    assert set("".join(prompts)) <= set(CHARSET)


def test_code_small_reference_solutions_pass_and_wrong_programs_fail() -> None:
    import ast

    rows = load_records(CODE_SMALL, required=["prompt", "tests", "solution"])
    assert len(rows) >= 12
    wrong = []
    for row in rows:
        name = next(n.name for n in ast.parse(row["solution"]).body if isinstance(n, ast.FunctionDef))
        wrong.append(f"def {name}(*args):\n    return None\n")
    results = run_many(
        [(r["solution"], r["tests"]) for r in rows] + list(zip(wrong, [r["tests"] for r in rows], strict=True)),
        workers=4,
    )
    assert [r.passed for r in results[: len(rows)]] == [True] * len(rows), [r.error for r in results]
    assert not any(r.passed for r in results[len(rows):])
    # The same verdicts through the task: a fenced reference solution scores 1, a wrong one 0.
    task = build_task("dataset", path=str(CODE_SMALL), verifier="code")
    example = task.eval_split(1)[0]
    assert task.reward(example, f"Here:\n```python\n{example.meta['solution']}```") == 1.0
    assert task.reward(example, "```python\ndef f():\n    pass\n```") == 0.0


# ------------------------------------------------------------- end to end

TINY = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64", "model.max_positions=160",  # shipped prompts are up to 138 characters
    "sft.enabled=false", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
    "train.micro_batch_size=8", "rollout.max_new_tokens=8", "eval.num_prompts=4", "eval.num_samples=2",
    "log.progress=false", "threads=1", "task.name=dataset",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "options", "eval_prompts"),
    [(MATH_SMALL, ["task.options.verifier=math"], 4),
     # The code set's hash split holds 2 held-out problems: eval.num_prompts=4 is capped to them.
     (CODE_SMALL, ["task.options.verifier=code", "task.options.code_timeout_s=10", "train.num_prompts=8"], 2)],
    ids=["math", "code"],
)
def test_short_rl_run_on_a_shipped_dataset(tmp_path: Path, data: Path, options: list[str], eval_prompts: int) -> None:
    cfg = build_config([*TINY, f"task.options.path={data}", *options, f"output_dir={tmp_path / 'run'}"])
    result = run(cfg)
    lines = [json.loads(x) for x in (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and math.isfinite(r["grad_norm"]) for r in rl)
    summary = result.summary
    assert summary["task"] == "dataset" and summary["rl_steps"] == 2 and summary["sft"] is None
    for stage in ("start", "final"):
        ev = summary["eval"][stage]
        assert ev["num_prompts"] == eval_prompts and ev["num_samples"] == 2
        assert 0.0 <= ev["pass@1"] <= 1.0 and 0.0 <= ev["greedy_accuracy"] <= 1.0


def test_a_dataset_without_completions_stops_before_the_run_directory_exists(tmp_path):
    from typer.testing import CliRunner

    from reinforge.cli import app
    from reinforge.data import MATH_SMALL

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "task.name=dataset", f"task.options.path={MATH_SMALL}",
                                      f"output_dir={out}"])
    assert result.exit_code == 2 and "sft.enabled=false" in result.output
    assert not out.exists()


# ------------------------------------------------- layouts people bring (TRL, verl)

VERL_ROWS = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": f"What is {i} + 1?"}],
     "ability": "math", "reward_model": {"ground_truth": str(i + 1), "style": "rule"},
     "extra_info": {"index": i, "split": "train", "answer": f"#### {i + 1}"}}
    for i in range(3)
]


def test_verl_parquet_layout_dotted_paths_and_messages(tmp_path: Path) -> None:
    import datasets

    from reinforge.data.chat import Conversation

    datasets.Dataset.from_list(VERL_ROWS).to_parquet(str(tmp_path / "verl.parquet"))
    records = load_records(
        tmp_path / "verl.parquet",
        {"answer": "reward_model.ground_truth", "index": "extra_info.index"},
        required=["prompt", "answer"],
    )
    assert [r["answer"] for r in records] == ["1", "2", "3"] and [r["index"] for r in records] == [0, 1, 2]
    prompt = records[1]["prompt"]
    assert isinstance(prompt, Conversation) and prompt == "system: Think.\nuser: What is 1 + 1?"
    assert prompt.as_list() == VERL_ROWS[1]["prompt"]
    # The nested columns stay whole under their own names, for verl's compute_score.
    assert (
        records[2]["reward_model"] == {"ground_truth": "3", "style": "rule"}
        and records[2]["data_source"] == "openai/gsm8k"
    )
    # The dataset task reads the answer from reward_model.ground_truth unasked (verl's layout), and says so.
    task = build_task("dataset", path=str(tmp_path / "verl.parquet"), eval_path=str(tmp_path / "verl.parquet"))
    assert [e.answer for e in task.eval_split(3)] == ["1", "2", "3"]
    assert task.eval_split(1)[0].meta["extra_info"]["answer"] == "#### 1"


def test_trl_solution_column_is_the_answer_and_stays_a_column(tmp_path: Path, caplog) -> None:
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "solution": "6"}]
    path = _write_jsonl(tmp_path / "trl.jsonl", [json.dumps(r) for r in rows])
    with caplog.at_level("WARNING"):
        task = build_task("dataset", path=str(path), eval_path=str(path))
    assert "has no 'answer' column: using 'solution' (set task.options.fields.answer to choose another)" in caplog.text
    examples = task.eval_split(2)
    assert [(e.answer, e.meta["solution"]) for e in examples] == [("4", "4"), ("6", "6")]
    assert examples[0].prompt.as_list() == rows[0]["prompt"]


def test_a_missing_field_names_the_columns_and_the_mapping_that_fixes_it(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "1+1?", "meta": {"gold": "2", "level": 1}})])
    with pytest.raises(DatasetError) as err:
        build_task("dataset", path=str(path), eval_path=str(path))
    assert str(err.value) == (
        f"'{path}', line 1: field 'prompt' is missing; the row's columns: question, meta, meta.gold, meta.level; "
        "map one with task.options.fields.prompt=question")
    with pytest.raises(DatasetError) as err:
        build_task("dataset", path=str(path), eval_path=str(path), fields={"prompt": "question", "answer": "gold"})
    assert str(err.value) == (
        f"'{path}', line 1: field 'answer' (column 'gold') is missing; the row's columns: question, meta, meta.gold, "
        "meta.level; fix task.options.fields.answer=meta")
    # The fix the message points at, as a dotted path.
    task = build_task(
        "dataset", path=str(path), eval_path=str(path), fields={"prompt": "question", "answer": "meta.gold"}
    )
    assert task.eval_split(1)[0].answer == "2"


def test_csv_arrow_json_array_and_a_folder_of_data_files(tmp_path: Path) -> None:
    import datasets

    rows = [{"question": "a?", "gold": "1"}, {"question": "b?", "gold": "2"}]
    expected = [{"prompt": "a?", "answer": "1", "question": "a?", "gold": "1"},
                {"prompt": "b?", "answer": "2", "question": "b?", "gold": "2"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "d.arrow").write_bytes(next((tmp_path / "saved").glob("*.arrow")).read_bytes())
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    (tmp_path / "folder").mkdir()
    ds.to_parquet(str(tmp_path / "folder" / "train.parquet"))
    ds.select([1]).to_parquet(str(tmp_path / "folder" / "test.parquet"))
    # CSV has no types: pandas reads the column of digits as integers (our answer is still text).
    assert load_records(tmp_path / "d.csv", FIELDS) == [{**e, "gold": int(e["gold"])} for e in expected]
    assert load_records(tmp_path / "d.arrow", FIELDS) == expected
    assert load_records(tmp_path / "d.json", FIELDS) == expected
    assert load_records(f"{tmp_path / 'folder'}::test", FIELDS) == expected[1:]
    with pytest.raises(DatasetError, match=r"several splits \(.*\): pick one with"):
        load_records(tmp_path / "folder", FIELDS)
    # An empty CSV cell is a missing value, not NaN.
    (tmp_path / "holes.csv").write_text("question,gold\na?,\n")
    with pytest.raises(DatasetError, match=r"row 1: field 'answer' \(column 'gold'\) is null"):
        load_records(tmp_path / "holes.csv", FIELDS)


def test_a_loading_script_folder_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "myset").mkdir()
    (tmp_path / "myset" / "myset.py").write_text("import datasets\n")
    with pytest.raises(DatasetError, match="datasets loading script: the pinned datasets 5.x no longer runs loading "
                                           "scripts; convert the data to Parquet or JSONL"):
        load_records(tmp_path / "myset")


def test_prompt_system_makes_every_prompt_a_conversation(tmp_path: Path) -> None:
    from reinforge.data.chat import Conversation

    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "1+1?", "answer": "2"}),
            json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}),
            json.dumps(
                {"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "3+3?"}], "answer": "6"}
            ),
        ],
    )
    task = build_task("dataset", path=str(path), eval_path=str(path))
    assert not isinstance(task.eval_split(1)[0].prompt, Conversation)
    task.system = "Be brief."
    prompts = [e.prompt.as_list() for e in task.eval_split(3)]
    assert prompts == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        [{"role": "system", "content": "Own."}, {"role": "user", "content": "3+3?"}],  # its own system message stays
    ]
    sft = build_task("arithmetic")
    sft.system = "Add."
    (trace,) = sft.sft_examples(1, corrupt_fraction=0.0, seed=0)
    assert trace.prompt.as_list()[0] == {"role": "system", "content": "Add."}
    with pytest.raises(DatasetError, match="line 2: the prompt is a list of messages, which prompt_template"):
        build_task("dataset", path=str(path), eval_path=str(path), prompt_template="Q: {prompt}")
    # A conversation survives pickling (async sampler, Ray workers) and `reinforge filter`'s file.
    import pickle

    from reinforge.curation.difficulty import write_filtered

    examples = task.eval_split(3)
    assert pickle.loads(pickle.dumps(examples[0].prompt)).as_list() == prompts[0]
    write_filtered(tmp_path / "kept.jsonl", examples, [0.5, 0.5, 0.5], 0.1, 0.9)
    again = build_task("dataset", path=str(tmp_path / "kept.jsonl"), eval_path=str(tmp_path / "kept.jsonl"))
    assert [e.prompt.as_list() for e in again.eval_split(3)] == prompts
