"""PRM-guided search on real built-in games: best-of-N (blind and lookahead) and beam search with scripted policies
and a scripted PRM, and the controls (random, rule, log-probability)."""

from __future__ import annotations

import math

import pytest

from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.stats import derive_seed
from clemprm.play.contract import Pair, Scorer
from clemprm.search import RandomScorer, RuleScorer
from clemprm.search.beam_search import Beam, beam_search
from clemprm.search.best_of_n import best_of_n
from tests.conftest import binary_search_answer, tiny_config

SAMPLING = Sampling(temperature=0.7, max_new_tokens=16)
JUNK = "I have no idea."


class ScriptedPRM(Scorer):
    """A test double of :class:`clemprm.models.prm.PRMScorer`: ``score`` is ``value(messages, candidate)`` (what a
    fork shows aside); every call is recorded."""

    def __init__(self, value):
        self.value = value
        self.calls: list[list[Pair]] = []

    def score(self, pairs):
        self.calls.append(list(pairs))
        return [self.value(pair.perspective, pair.candidate) for pair in pairs]


@pytest.fixture(scope="module")
def catalog():
    return GameCatalog(tiny_config()["games"])


@pytest.fixture(scope="module")
def seeded_policy(scripted_policy):
    from clemprm.play.contract import Generation

    class SeededPolicy(scripted_policy):
        """A policy whose answer is ``answer(messages, seed)``: candidates differ by seed, as sampled ones do."""

        def generate(self, perspectives, seeds=None, temperature=None, top_p=None, max_new_tokens=None):
            self.calls.append(len(perspectives))
            texts = [self.answer(messages, seed) for messages, seed in zip(perspectives, seeds)]
            return [Generation(text=text, raw_text=text, prompt_tokens=1, new_tokens=len(text.split()))
                    for text in texts]

    return SeededPolicy


def start(engine, instances, policy, repeats=1):
    return [engine.start(instance, [policy], f"{'/'.join(map(str, instance.key))}/{r}",
                         derive_seed(7, "test", *instance.key, r))
            for instance in instances for r in range(repeats)]


def any_game_answer(messages):
    """Perfect guessnumber play; a fixed (usually wrong) answer in the other games."""
    if "GUESS" in messages[0]["content"]:
        return binary_search_answer(messages)
    return "DESCRIPTION: something you can hold" if "DESCRIPTION" in messages[0]["content"] else "ANSWER: apple"


def test_best_of_n_plays_the_candidate_the_prm_prefers(catalog, seeded_policy):
    instances = catalog.instances("guessnumber", "validation")

    def answer(messages, seed):  # half of the samples play perfectly, half break the rules
        return binary_search_answer(messages) if seed % 2 else JUNK

    def run(prefers):
        engine = RolloutEngine(catalog, SAMPLING)
        episodes = start(engine, instances, seeded_policy(answer))
        prm = ScriptedPRM(lambda messages, candidate: 1.0 if candidate == prefers(messages) else 0.0)
        costs = best_of_n(engine, episodes, prm, 8, SAMPLING)
        return [episode.record("p", SAMPLING) for episode in episodes], costs, prm

    rows, costs, prm = run(binary_search_answer)
    assert all(row["success"] for row in rows)
    scored = {}
    for pairs in prm.calls:
        assert [pair.slot for pair in pairs] == list(range(8)) * (len(pairs) // 8)   # each waiting game's 8 slots
        for pair in pairs:
            assert pair.reply is None and pair.accepted is None   # blind: no game saw the candidate
            scored.setdefault(str(pair.perspective), set()).add(pair.candidate)
    assert any(JUNK in candidates for candidates in scored.values())  # the PRM had to choose
    for row in rows:
        for turn in row["turns"]:
            assert turn["response"] == binary_search_answer(turn["messages"])
    assert [cost.nodes for cost in costs] == [8 * row["n_turns"] for row in rows]
    assert sum(cost.prm_pairs for cost in costs) == sum(map(len, prm.calls))

    rows, _, _ = run(lambda messages: JUNK)  # a PRM that prefers breaking the rules gets aborted games
    assert all(row["aborted"] for row in rows)


def test_lookahead_best_of_n_reads_each_fork_and_the_rule_control_picks_what_the_game_accepts(catalog,
                                                                                              seeded_policy):
    """Lookahead: every candidate is played in a fork and the scorer sees the game's reply and verdict; the rule
    control (no model) then plays the winning or accepted answer, where the same search ranked blind at random
    cannot tell them apart."""
    instances = catalog.instances("guessnumber", "validation")

    def answer(messages, seed):  # half of the samples play perfectly, half break the rules
        return binary_search_answer(messages) if seed % 2 else JUNK

    engine = RolloutEngine(catalog, SAMPLING)
    episodes = start(engine, instances, seeded_policy(answer))
    seen = []

    class Recording(RuleScorer):
        def score(self, pairs):
            seen.extend(pairs)
            return super().score(pairs)

    costs = best_of_n(engine, episodes, Recording(), 8, SAMPLING, lookahead=True)
    rows = [episode.record("p", SAMPLING) for episode in episodes]
    assert all(row["success"] for row in rows)   # the rule never plays a rejected answer when another was accepted
    assert {pair.accepted for pair in seen} == {True, False}
    assert [pair.slot for pair in seen] == list(range(8)) * (len(seen) // 8)   # each fork knows its slot
    assert all(pair.reply for pair in seen) and any(pair.reply == "Game over: won." for pair in seen)
    assert all(pair.accepted is False for pair in seen if pair.candidate == JUNK)
    assert [cost.nodes for cost in costs] == [8 * row["n_turns"] for row in rows]
    assert all(cost.prm_pairs > 0 for cost in costs)


def test_rule_scorer_reads_the_game_verdict_then_acceptance_and_refuses_blind_pairs():
    messages = [{"role": "user", "content": "Guess."}]
    pairs = [Pair(messages, "a", "Game over: won.", True), Pair(messages, "b", "Game over: lost.", True),
             Pair(messages, "c", "Game over: aborted.", False), Pair(messages, "d", "Higher.", True),
             Pair(messages, "e", "Invalid answer. Try again.", False)]
    assert RuleScorer().score(pairs) == [1.0, 0.1, 0.0, 0.5, 0.2]
    with pytest.raises(ValueError, match="lookahead"):
        RuleScorer().score([Pair(messages, "a")])


def test_best_of_n_one_generate_call_and_one_prm_call_per_step_across_games(catalog, seeded_policy):
    instances = catalog.all_instances("validation")
    assert len({instance.game for instance in instances}) == 3
    policy = seeded_policy(lambda messages, seed: any_game_answer(messages))
    prm = ScriptedPRM(lambda messages, candidate: 0.5)
    engine = RolloutEngine(catalog, SAMPLING)
    episodes = start(engine, instances, policy)
    best_of_n(engine, episodes, prm, 3, SAMPLING)
    assert all(episode.done for episode in episodes)
    assert len(policy.calls) == len(prm.calls) > 1
    assert policy.calls[0] == 3 * len(episodes) == len(prm.calls[0])
    assert policy.calls == [len(pairs) for pairs in prm.calls]


def test_beam_search_with_width_1_and_one_candidate_is_greedy_play(catalog, scripted_policy):
    instances = catalog.all_instances("validation")
    greedy_engine = RolloutEngine(catalog, Sampling())
    greedy = start(greedy_engine, instances, scripted_policy(any_game_answer))
    greedy_engine.run(greedy)
    engine = RolloutEngine(catalog, Sampling())
    roots = start(engine, instances, scripted_policy(any_game_answer))
    chosen, costs = beam_search(engine, roots, ScriptedPRM(lambda messages, candidate: 0.5), n=1, beam_width=1,
                                iterations=20, sampling=Sampling())
    assert {"wordref", "oddoneout", "guessnumber"} == {instance.game for instance in instances}
    for a, b, cost in zip(greedy, chosen, costs):
        row_a, row_b = a.record("p", Sampling()), b.record("p", Sampling())
        assert row_a == row_b
        assert cost.nodes == cost.prm_pairs == row_b["n_turns"]


def test_beam_search_batches_all_beams_of_all_games(catalog, seeded_policy):
    instances = catalog.all_instances("validation")
    policy = seeded_policy(lambda messages, seed: f"GUESS: {seed % 10 + 1}" if "GUESS" in messages[0]["content"]
                           else any_game_answer(messages))
    prm = ScriptedPRM(lambda messages, candidate: derive_seed(candidate) % 100 / 100)
    engine = RolloutEngine(catalog, SAMPLING)
    roots = start(engine, instances, policy)
    chosen, costs = beam_search(engine, roots, prm, n=3, beam_width=2, iterations=20, sampling=SAMPLING)
    assert len(policy.calls) == len(prm.calls) > 1
    assert policy.calls[0] == 3 * len(roots)
    assert max(policy.calls) > 3 * len(roots)   # later iterations expand two beams per game
    assert sum(cost.prm_pairs for cost in costs) == sum(map(len, prm.calls))
    assert all(episode.done for episode in chosen)
    assert [episode.episode_id for episode in chosen] == [root.episode_id for root in roots]
    assert [episode.seed for episode in chosen] == [root.seed for root in roots]


def test_beam_search_prefers_any_finished_game_over_a_better_scored_unfinished_one(catalog, seeded_policy):
    instance = next(i for i in catalog.instances("guessnumber", "validation") if i.experiment["max_guesses"] >= 4)
    target = instance.instance["target"]
    wrong = 1 if target != 1 else 2
    policy = seeded_policy(lambda messages, seed: f"GUESS: {target if seed % 2 else wrong}")
    prm = ScriptedPRM(lambda messages, candidate: 0.9 if candidate == f"GUESS: {wrong}" else 0.1)
    engine = RolloutEngine(catalog, SAMPLING)
    (chosen,), _ = beam_search(engine, start(engine, [instance], policy), prm, n=8, beam_width=1, iterations=1,
                               sampling=SAMPLING)
    assert {pair.candidate for pairs in prm.calls for pair in pairs} == {f"GUESS: {target}", f"GUESS: {wrong}"}
    row = chosen.record("p", SAMPLING)
    assert row["success"] and row["n_turns"] == 1

    never_wins = seeded_policy(lambda messages, seed: f"GUESS: {wrong}")   # nothing finishes in 2 iterations
    (chosen,), _ = beam_search(engine, start(engine, [instance], never_wins), prm, n=2, beam_width=1, iterations=2,
                               sampling=SAMPLING)
    row = chosen.record("p", SAMPLING)
    assert row["aborted"] and row["error"] == "episode not finished" and row["n_turns"] == 2


def test_beam_scores_aggregate_last_min_or_prod():
    beam = Beam(episode=None, step_scores=[0.5, 0.9, 0.8])
    assert beam.score("last") == 0.8 and beam.score("min") == 0.5 and beam.score("prod") == pytest.approx(0.36)
    assert Beam(episode=None).score("last") == -math.inf
    # log-probabilities: prod is the product of the probabilities they stand for, so the likelier path ranks first
    likely, unlikely = Beam(None, step_scores=[-0.1, -0.1]), Beam(None, step_scores=[-0.5, -2.0])
    assert likely.score("prod", log_scale=True) > unlikely.score("prod", log_scale=True)
    assert likely.score("prod", log_scale=True) == pytest.approx(math.log(math.exp(-0.1) ** 2))
    with pytest.raises(ValueError, match="aggregation"):
        beam_search(None, [], None, n=1, beam_width=1, iterations=1, sampling=SAMPLING, aggregation="mean")


def test_random_scorer_is_a_seeded_uniform_function_of_the_turn_and_the_slot():
    messages = [{"role": "user", "content": "Which word does not belong?"}]
    pairs = [Pair(messages, "ANSWER: pear", "Wrong.", False, slot) for slot in range(400)]
    scores = RandomScorer(0).score(pairs)
    assert scores == RandomScorer(0).score(pairs) and scores != RandomScorer(1).score(pairs)
    assert RandomScorer(0).score(pairs[::-1]) == scores[::-1]          # no dependence on the batch
    assert all(0 <= score < 1 for score in scores) and 0.45 < sum(scores) / len(scores) < 0.55
    other = [Pair([{"role": "user", "content": "Another game"}], pair.candidate, slot=pair.slot) for pair in pairs[:50]]
    assert RandomScorer(0).score(other) != scores[:50]                  # the perspective (the turn) counts too
    renamed = [pair._replace(candidate=f"ANSWER: {pair.slot}") for pair in pairs]
    assert RandomScorer(0).score(renamed) == scores                     # the text does not


def test_random_of_n_picks_one_of_the_n_samples_at_random_so_a_repeated_answer_by_its_count():
    """A turn whose 4 candidates are A, A, A, B: over 2000 seeds (a fixed list: the test cannot flake) the random
    control plays A in about 3/4 of them (binomial sd 0.01), as a random one of the 4 samples would; a score of the
    text picked A in about 1/2 (uniform over the distinct answers)."""
    messages = [{"role": "user", "content": "Guess a number from 1 to 10."}]
    texts = ["GUESS: 5", "GUESS: 5", "GUESS: 5", "GUESS: 7"]
    pairs = [Pair(messages, text, slot=slot) for slot, text in enumerate(texts)]
    picks = []
    for seed in range(2000):
        scores = RandomScorer(seed).score(pairs)
        picks.append(texts[max(range(len(texts)), key=scores.__getitem__)])   # best_of_n's pick
    assert 0.72 < picks.count("GUESS: 5") / len(picks) < 0.78


@pytest.fixture(scope="module")
def tiny_policy(test_cache_dir):
    from clemprm.models.generation import load_policy
    return load_policy(tiny_config()["model"], test_cache_dir)


def test_logprob_scorer_is_the_policys_mean_token_logprob_of_the_candidate(tiny_policy):
    import torch

    from clemprm.models.logprob import LogprobScorer

    short = [{"role": "user", "content": "Guess a number."}]
    long = [{"role": "user", "content": "Name the odd word out: apple, pear, plum, chair. Answer with one word."}]
    pairs = [Pair(short, "GUESS: 5", "Higher.", True), Pair(long, "ANSWER: chair"), Pair(short, "GUESS: 12 please"),
             Pair(long, "pear", "Invalid answer.", False), Pair(short, "")]
    scorer = LogprobScorer(tiny_policy)
    scores = scorer.score(pairs)
    assert scorer.stats.shared_tokens > 0   # the candidates of one prompt passed it once (checked equal below)
    tokenizer, model = tiny_policy.tokenizer, tiny_policy.model
    for (prefix, candidate, *_), score in zip(pairs, scores):  # each pair alone, unpadded, without a cache
        prompt = tokenizer(tiny_policy.render(prefix), add_special_tokens=False)["input_ids"]
        answer = tokenizer(candidate, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(answer)[:, None])
        assert score == pytest.approx(logprobs.mean().item(), abs=1e-4)
    assert len(set(scores)) == len(pairs)


def test_best_of_n_with_a_trained_prm_plays_the_marker_candidate(catalog, seeded_policy, tmp_path, test_cache_dir):
    """The real PRM in the loop: trained (tiny model) on oddoneout train prompts where answers naming the marker
    word are labelled high, it then picks the marker answer among sampled ones on unseen validation prompts."""
    from clemprm import records
    from clemprm.models.prm import load_prm
    from clemprm.stages import prm
    from tests.test_prm import MARKER, NEGATIVE, POSITIVE, WORDS, prm_settings, soft_label_row

    engine = RolloutEngine(catalog, SAMPLING)
    train = start(engine, catalog.instances("oddoneout", "train"), seeded_policy(lambda messages, seed: JUNK))
    rows = []
    for episode in train:
        prefix = engine.waiting(episode)[1]
        game, experiment, game_id = episode.instance.key
        for turn, word in enumerate(WORDS[:4]):
            marked = turn % 2 == 0
            candidate = f"ANSWER: {MARKER if marked else word}"
            played = engine.replay(episode.fork(), [candidate])   # the game's reply, as the search will see it
            rows.append({**soft_label_row(game, experiment, game_id, turn, prefix, candidate,
                                          POSITIVE if marked else NEGATIVE), "reply": played.turns[-1]["reply"]})
    settings = prm_settings(lr=3e-3, epochs=8, batch_size=8, grad_accum=1, validation_fraction=0.0)
    labels_path = tmp_path / "labels.parquet"
    records.write_records(labels_path, rows, records.SOFT_LABELS, {})
    prm.train_prm(settings, str(labels_path), str(tmp_path / "adapter"), str(tmp_path / "predictions.parquet"),
                  test_cache_dir)
    scorer = load_prm(settings["model"], settings["prm"], str(tmp_path / "adapter"), test_cache_dir)

    def answer(messages, seed):  # one sample in three names the marker
        return f"ANSWER: {MARKER}" if seed % 3 == 0 else f"ANSWER: {WORDS[seed % 7]}"

    episodes = start(engine, catalog.instances("oddoneout", "validation"), seeded_policy(answer))
    proposed = {}

    class RecordingPRM(Scorer):  # the trained scorer, recording what it was asked
        def score(self, pairs):
            for pair in pairs:
                proposed.setdefault(str(pair.perspective), set()).add(pair.candidate)
            return scorer.score(pairs)

    best_of_n(engine, episodes, RecordingPRM(), 12, SAMPLING)
    first_turns = [episode.turns[0] for episode in episodes]
    assert first_turns and all(len(proposed[str(turn["messages"])]) > 1 for turn in first_turns)  # a choice
    assert all(turn["response"] == f"ANSWER: {MARKER}" for turn in first_turns
               if f"ANSWER: {MARKER}" in proposed[str(turn["messages"])])
    assert sum(f"ANSWER: {MARKER}" in proposed[str(turn["messages"])] for turn in first_turns) >= 1
