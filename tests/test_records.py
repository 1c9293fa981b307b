"""A bad input record file fails every stage with an error naming the file: real record files cut short (a killed
copy, a full disk), record files of another stage, and a column of another type."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clemprm import records
from clemprm.evaluation import evaluate
from clemprm.stages import branch_points, labels, prm, rollouts, sft
from tests.conftest import binary_search_answer, tiny_config

CONFIG = tiny_config(games={"builtin": ["guessnumber"]}, labels={"k": 2})

# the column each schema gets in another type (a foreign writer's file with the right names)
RETYPED = {"episodes": "game_id", "sft_data": "messages", "branch_points": "seed", "shard": "label",
           "soft_labels": "label", "eval": "game_id"}


@pytest.fixture(scope="module")
def real_files(tmp_path_factory, scripted_policy):
    """One real file of each record type, made by the stages themselves (a scripted perfect player)."""
    folder = tmp_path_factory.mktemp("records")
    policy = scripted_policy(binary_search_answer)
    paths = {name: folder / f"{name}.parquet" for name in RETYPED}
    rollouts.base_rollouts(CONFIG, str(paths["episodes"]), policy=policy)
    assert rollouts.win_filter(CONFIG, str(paths["episodes"]), str(paths["sft_data"]))
    branch_points.branch_points(CONFIG, None, str(folder / "sft_train_episodes.parquet"), str(paths["branch_points"]),
                                policy=policy)
    labels.soft_labels_shard(CONFIG, str(paths["branch_points"]), None, 0, 1, str(paths["shard"]), policy=policy)
    labels.gather_soft_labels(CONFIG, str(paths["branch_points"]), [str(paths["shard"])], str(paths["soft_labels"]))
    evaluate.evaluate_mode("greedy_base", CONFIG, str(paths["eval"]), policy=policy)
    assert all(records.read_records(path) for path in paths.values())
    return paths


def truncated(good, bad):
    data = good.read_bytes()
    bad.write_bytes(data[:len(data) * 2 // 3])


def other_record_type(good, bad):
    """A real record file of a neighbouring stage (episodes <-> SFT data, branch points <-> eval episodes)."""
    other = {"episodes": "sft_data", "sft_data": "episodes", "branch_points": "eval", "shard": "eval",
             "soft_labels": "branch_points", "eval": "soft_labels"}[good.stem]
    bad.write_bytes(good.with_name(f"{other}.parquet").read_bytes())


def retyped_column(good, bad):
    table = pq.read_table(good)
    name = RETYPED[good.stem]
    as_text = pa.array([str(value) for value in table.column(name).to_pylist()])
    pq.write_table(table.set_column(table.schema.get_field_index(name), name, as_text), bad)


def run_win_filter(paths, bad, out):
    rollouts.win_filter(CONFIG, str(bad), str(out / "sft_data.parquet"))


def run_sft(paths, bad, out):
    sft.train_sft(CONFIG, str(bad), str(out / "adapter"), str(out / "metrics.json"), str(out / "cache"))


def run_label_shard(paths, bad, out):
    labels.soft_labels_shard(CONFIG, str(bad), None, 0, 1, str(out / "shard.parquet"))


def run_gather_shard(paths, bad, out):
    labels.gather_soft_labels(CONFIG, str(paths["branch_points"]), [str(paths["shard"]), str(bad)],
                              str(out / "soft_labels.parquet"))


def run_gather_branch_points(paths, bad, out):
    labels.gather_soft_labels(CONFIG, str(bad), [str(paths["shard"])], str(out / "soft_labels.parquet"))


def run_prm(paths, bad, out):
    prm.train_prm(CONFIG, str(bad), str(out / "adapter"), str(out / "predictions.parquet"), str(out / "cache"))


def run_eval_summary(paths, bad, out):
    evaluate.summarize_eval(CONFIG, [str(paths["eval"]), str(bad)], str(out / "prm_eval.json"))


# (stage, the input it gets bad, the record type that input is)
STAGE_INPUTS = [(run_win_filter, "episodes"), (run_sft, "sft_data"), (run_label_shard, "branch_points"),
                (run_gather_shard, "shard"), (run_gather_branch_points, "branch_points"), (run_prm, "soft_labels"),
                (run_eval_summary, "eval")]


@pytest.mark.parametrize("spoil", [truncated, other_record_type, retyped_column])
@pytest.mark.parametrize("stage, kind", STAGE_INPUTS, ids=[stage.__name__[4:] for stage, _ in STAGE_INPUTS])
def test_a_bad_input_file_is_an_error_naming_it(real_files, tmp_path, stage, kind, spoil):
    bad = tmp_path / f"bad-{kind}-{spoil.__name__}.parquet"
    spoil(real_files[kind], bad)
    with pytest.raises(records.RecordFileError, match=re.escape(str(bad))):
        stage(real_files, bad, tmp_path)
    assert not (tmp_path / "cache").exists()   # it failed on the file, before loading a model


def test_a_real_file_reads_back_with_its_schema(real_files):
    schemas = {"episodes": records.EPISODES, "sft_data": records.INTERACTIONS, "branch_points": records.BRANCH_POINTS,
               "shard": records.SOFT_LABELS, "soft_labels": records.SOFT_LABELS, "eval": records.EVAL_EPISODES}
    for kind, schema in schemas.items():
        assert records.read_table(real_files[kind], schema).schema.remove_metadata() == schema
    assert records.read_provenance(real_files["eval"])["run"]["mode"] == "greedy_base"


def test_provenance_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(records.RecordFileError, match="nowhere.parquet"):
        records.read_provenance(tmp_path / "nowhere.parquet")


@pytest.mark.parametrize("path, rule", [
    ("results/rollouts/base_train.parquet", "base_rollouts"), ("results/sft/sft_data.parquet", "win_filter"),
    ("results/labels/branch_points.parquet", "branch_points"), ("results/labels/shards/0-of-2.parquet", "soft_labels"),
    ("results/labels/soft_labels.parquet", "gather_soft_labels"), ("results/labels/answers.parquet", "gather_answers"),
    ("results/eval/best_of_n.parquet", "eval_mode")])
def test_a_corrupt_record_file_names_the_rule_to_force(tmp_path, path, rule):
    """Snakemake remakes a file only when it is older than its inputs: a corrupt one newer than them stays until
    forced."""
    bad = tmp_path / path
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(records.RecordFileError, match=re.escape(
            f"cannot read record file {bad}: ") + r".*" + re.escape(
            f" (rule {rule} writes it; Snakemake remakes it only when it is older than its inputs: snakemake "
            f"--forcerun {rule} remakes it)")):
        records.read_table(bad)
    other = tmp_path / "elsewhere.parquet"
    other.write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(records.RecordFileError, match=r"elsewhere.parquet: [^(]*$"):   # no rule writes it: no hint
        records.read_table(other)


def test_branch_points_of_older_code_without_multiplicity_fail_naming_the_column_and_the_rule(real_files, tmp_path):
    """A branch-point file written before the multiplicity column (a run of older code) is refused, naming the
    column and the rule that remakes it, rather than read as if every answer were sampled once."""
    old = pq.read_table(real_files["branch_points"]).drop_columns(["multiplicity"])
    path = tmp_path / "results/labels/branch_points.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(old, path)
    with pytest.raises(records.RecordFileError, match=re.escape("lacks columns ['multiplicity']") + r".*"
                       + re.escape("snakemake --forcerun branch_points remakes it")):
        records.read_records(path, records.BRANCH_POINTS)
