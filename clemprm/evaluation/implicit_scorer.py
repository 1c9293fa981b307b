"""The implicit PRM of a PRIME run as a PRM for the searches (eval mode ``best_of_n_implicit``).

A candidate's turn score is ``beta * sum_t log(pi_phi(y_t | y<t) / pi_ref(y_t | y<t))`` over its tokens, with
``pi_phi`` the trained implicit PRM (``results/rl/prime/adapter/prm``) and ``pi_ref`` its frozen initial weights
(the SFT adapter), both adapters on one base model. The candidate is scored as the policy would have written it: the
player's perspective rendered with the chat template and generation prompt (as the policy saw it), then the
candidate text and the template's end-of-turn token. Scores are log-odds, not probabilities: best-of-N only ranks
them. With ``eval.n`` candidates per turn from the same seeds as ``best_of_n``, the Monte-Carlo PRM and the
implicit PRM choose among the same candidates wherever the game states agree.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from clemprm.models.scoring import Counters
from clemprm.play.chat import end_of_turn_text, end_token_ids, render_prompt
from clemprm.play.contract import Pair, Scorer
from clemprm.rl.prime import ImplicitPRM
from clemprm.rl.rollouts import Turn

REFERENCE = "reference"


@dataclasses.dataclass
class ImplicitStats(Counters):
    """Running counters of the implicit PRM as a scorer."""

    calls: int = 0
    pairs: int = 0
    tokens: int = 0
    seconds: float = 0.0


class ImplicitPRMScorer(Scorer):
    """``score(pairs) -> [beta * sum log-ratio]`` for (perspective messages, candidate) pairs."""

    def __init__(self, cfg, sft_adapter: str, beta: float):
        from clemprm.models.loader import load_extra_adapter, load_tokenizer_and_model, resolve_dtype

        tokenizer, model = load_tokenizer_and_model(cfg, for_training=False, task="causal-lm")
        load_extra_adapter(model, str(sft_adapter), REFERENCE, trainable=False)
        model.set_adapter("default")
        model.eval()
        self.cfg, self.tokenizer, self.model = cfg, tokenizer, model
        self.end_text = end_of_turn_text(tokenizer, cfg.chat_template_kwargs,
                                         end_token_ids(tokenizer, model.generation_config))
        self.prm = ImplicitPRM(model, beta, adapter="default", reference=REFERENCE,
                               compute_dtype=resolve_dtype(cfg, next(model.parameters()).device.type))
        self.stats = ImplicitStats()

    def turn(self, messages: list[dict], candidate: str) -> Turn:
        """The candidate's tokens after the prompt the policy saw."""
        prompt = self.tokenizer(render_prompt(self.tokenizer, messages, self.cfg.chat_template_kwargs),
                                add_special_tokens=False)["input_ids"]
        answer = self.tokenizer(candidate + self.end_text, add_special_tokens=False)["input_ids"]
        return Turn(prompt, answer)

    def score(self, pairs: list[Pair]) -> list[float]:
        """The implicit PRM's reward of each candidate after its perspective (:class:`Pair`; what a
        fork shows plays no part)."""
        start = time.perf_counter()
        turns = [self.turn(pair.perspective, pair.candidate) for pair in pairs]
        with torch.no_grad():
            scores = [self.prm.score(turn) for turn in turns]
        self.stats.calls += 1
        self.stats.pairs += len(pairs)
        self.stats.tokens += sum(len(t.prompt_ids) + len(t.completion_ids) for t in turns)
        self.stats.seconds += time.perf_counter() - start
        return scores


def load_implicit_prm(model_settings: dict, rl_adapter: str, sft_adapter: str, beta: float,
                      cache_dir: str | None = None) -> ImplicitPRMScorer:
    """The implicit PRM of the RL adapter folder ``rl_adapter`` (its ``prm/`` sub-folder, written by PRIME)."""
    from clemprm.models.loader import ModelConfig

    folder = Path(rl_adapter) / "prm"
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{rl_adapter} holds no implicit PRM ({folder}): PRIME's RL stage trains one "
                                f"(prime in rl.algorithms, results/rl/prime/adapter)")
    cfg = ModelConfig.from_dict({**model_settings, "adapter": str(folder), "cache_dir": cache_dir})
    return ImplicitPRMScorer(cfg, sft_adapter, beta)
