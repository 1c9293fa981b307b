"""The lockstep engine plays exactly what clemcore's sequential runner plays (greedy decoding, tiny model)."""

from __future__ import annotations

import math

import pytest

from clemprm.catalog import GameCatalog
from clemprm.clemcore_runners import run_clemcore
from clemprm.engine import RolloutEngine, Sampling
from tests.conftest import tiny_config

MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_policy(test_cache_dir):
    from clemprm.models import ModelConfig, PolicyModel
    return PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir),
                       temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


@pytest.mark.parametrize("game", ["guessnumber", "wordref", "oddoneout"])
def test_lockstep_equals_sequential_runner(game, tiny_policy):
    catalog = GameCatalog(tiny_config(games={"max_instances": {"train": 4, "validation": 4, "test": 4}})["games"])
    instances = catalog.instances(game, "validation")
    engine = RolloutEngine(catalog, Sampling(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS))
    ours = engine.play(instances, [tiny_policy], repeats=1, base_seed=0, stage="test", policy_name=tiny_policy.name)
    reference = run_clemcore("sequential", catalog.benchmarks[game], instances, tiny_policy)
    for row, ref in zip(ours, reference):
        assert row["error"] is None
        assert [turn["response"] for turn in row["turns"]] == ref.responses
        assert row["aborted"] == bool(ref.scores["Aborted"])
        assert row["success"] == bool(ref.scores["Success"])
        ref_score = float(ref.scores["Main Score"])
        assert (math.isnan(row["bench_score"]) and math.isnan(ref_score)) or row["bench_score"] == ref_score
