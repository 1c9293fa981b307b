"""The process reward model as a scorer: :class:`PRMScorer` gives P(success | prefix messages + candidate), or, for a
PRM trained on what a fork shows (``prm.input: candidate_with_reply``, lookahead only), P(success | prefix + candidate
+ the game's reply to it).

Model
    ``AutoModelForSequenceClassification(num_labels=1)`` on ``prm.base_model`` (null: the policy's ``model.spec``),
    loaded by the one model loader with the ``model`` section's settings (``quantization: auto`` = 4-bit NF4 on
    CUDA), plus the PEFT LoRA adapter the ``prm_adapter`` stage trains (:mod:`clemprm.stages.prm`). The output is
    ``sigmoid(logit)``. The policy's own ``model.adapter`` never applies to the PRM.

Text of a pair
    One function, :func:`encode_pair`, for training and scoring: the prefix (the player's perspective exactly as the
    policy saw it) and the candidate as the assistant's turn (:func:`clemprm.play.chat.render_answered`); with
    ``prm.input: candidate_with_reply`` also the game's reply to it as the next user message (the turn record's,
    :meth:`clemprm.play.engine.RolloutEngine.game_reply`: feedback, a reprompt after a broken rule, the next
    player's message or the game's end), which only a lookahead search, playing every candidate in a fork, can
    read. A text longer than ``max_length`` tokens keeps its end (the reply, the candidate and the most recent
    context). Sequence classification pools the last non-pad token, so the loader
    gives the tokenizer a pad token that differs from the end-of-turn token, and batches are padded on the right
    (recurrent layers such as Qwen3.5's Gated DeltaNet never see padding before a real token). Pairs with the same
    prefix messages share their common token prefix (:mod:`clemprm.models.scoring`).

Kinds (``prm.kind``)
    ``lora`` is the model above. ``probe`` (:mod:`clemprm.models.probe`) reads the frozen policy's hidden states of
    the same text into linear heads: :class:`ProbeScorer`, a :class:`PRMScorer` with the same ``score(pairs)``,
    text and counters. :func:`load_prm` returns either from the config's ``prm`` section.
"""

from __future__ import annotations

import json
import logging
import math
import time

from clemprm.models.loader import ModelConfig, load_tokenizer_and_model, resolve_dtype
from clemprm.modes import PRM_INPUT_REGIMES
from clemprm.models.probe import ProbeFeatures, ProbeHead, policy_model_config, read_probe_config
from clemprm.models.scoring import (PrefixGroup, ScorerStats, forward_on_shared_prefixes, group_batches, micro_batches,
                                    pad_right, prefix_sharing_problem, shared_prefix_groups)
from clemprm.play.chat import render_answered
from clemprm.play.contract import Pair, Scorer

log = logging.getLogger(__name__)


INPUTS = tuple(PRM_INPUT_REGIMES)   # prm.input: what the PRM reads after the prefix


def encode_pair(tokenizer, prefix: list[dict], candidate: str, reply: str, chat_template_kwargs: dict | None,
                max_length: int) -> tuple[list[int], bool]:
    """THE tokens the PRM reads for ``(prefix, candidate, reply)`` (``reply`` "" for a PRM that reads the candidate
    alone), in training and in scoring, truncated from the left (the last ``max_length`` tokens: the reply, the
    candidate and the most recent context), and whether anything was cut."""
    text = render_answered(tokenizer, prefix, candidate, chat_template_kwargs, reply=reply)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_length:], len(ids) > max_length


class PRMScorer(Scorer):
    """P(success) of :class:`Pair` from the PRM (base + adapter ``cfg.adapter``), reading what it was
    trained on (``input``: the candidate, or the candidate with the game's reply).

    ``token_budget`` (default ``cfg.token_budget``) bounds the padded tokens of one forward pass; pairs are
    sorted by length so a micro-batch holds similar lengths. With ``share_prefixes`` (where the model's cache
    allows it) the token prefix common to the pairs of one prefix is computed once. A score does not depend on
    the batch it is in nor on sharing (up to float rounding)."""

    def __init__(self, cfg: ModelConfig, *, input: str = "candidate", max_length: int = 1024,
                 token_budget: int | None = None, tokenizer=None, model=None, share_prefixes: bool = True):
        if input not in INPUTS:
            raise ValueError(f"unknown PRM input {input!r} (known: {', '.join(INPUTS)})")
        self.cfg = cfg
        self.input = input
        if model is None or tokenizer is None:
            tokenizer, model = load_tokenizer_and_model(cfg, for_training=False, task="seq-cls")
        self.tokenizer, self.model = tokenizer, model
        self.max_length = int(max_length)
        self.token_budget = int(token_budget or cfg.token_budget)
        self.stats = ScorerStats()
        self.share_prefixes = share_prefixes
        if share_prefixes and (problem := prefix_sharing_problem(model)):
            log.info("prm %s: every pair scored in full, without shared prefixes: %s", cfg.short_name, problem)
            self.share_prefixes = False

    def score(self, pairs: list[Pair]) -> list[float]:
        """P(success) for each :class:`Pair` (perspective, candidate and, for a PRM that reads it,
        the game's reply); pairs with the same perspective share their common token prefix; length-sorted
        micro-batches under a token budget, left truncation."""
        reads_reply = self.input == "candidate_with_reply"
        if reads_reply and any(pair.reply is None for pair in pairs):
            raise ValueError("this PRM was trained on the candidate with the game's reply (prm.input: "
                             "candidate_with_reply): it scores lookahead pairs only, never a blind search's")
        start = time.perf_counter()
        sequences = []
        for pair in pairs:
            ids, truncated = encode_pair(self.tokenizer, pair.perspective, pair.candidate,
                                         pair.reply if reads_reply else "", self.cfg.chat_template_kwargs,
                                         self.max_length)
            sequences.append(ids)
            self.stats.truncated += truncated
        scores = self.score_ids(sequences, keys=[json.dumps(pair.perspective, sort_keys=True, default=str)
                                                 for pair in pairs])
        self.stats.calls += 1
        self.stats.pairs += len(pairs)
        self.stats.tokens += sum(len(ids) for ids in sequences)
        self.stats.seconds += time.perf_counter() - start
        return scores

    def score_ids(self, sequences: list[list[int]], keys: list | None = None) -> list[float]:
        """P(success) of already encoded pairs; the pairs of one key (e.g. the same prefix messages) compute their
        common token prefix once. On CUDA under autocast to the configured compute dtype: a model just prepared for
        4-bit training keeps its score head and norms in fp32 while its 4-bit layers compute in bf16."""
        import torch

        scores = [math.nan] * len(sequences)
        groups, alone = shared_prefix_groups(sequences, keys if self.share_prefixes else None)
        device = next(self.model.parameters()).device
        dtype = resolve_dtype(self.cfg, device.type)
        was_training = self.model.training
        self.model.eval()
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype,
                                                    enabled=device.type == "cuda" and dtype != torch.float32):
            for batch in micro_batches([len(sequences[i]) for i in alone], self.token_budget):
                rows = [alone[i] for i in batch]
                input_ids, attention_mask = pad_right([sequences[i] for i in rows], self.tokenizer.pad_token_id)
                for i, value in zip(rows, self._forward(input_ids, attention_mask)):
                    scores[i] = value
            for batch in group_batches(groups, self.token_budget):
                for i, value in zip([i for group in batch for i in group.rows], self._score_shared(sequences, batch)):
                    scores[i] = value
        self.model.train(was_training)
        self.stats.shared_tokens += sum(group.shared * (len(group.rows) - 1) for group in groups)
        return scores

    def _score_shared(self, sequences: list[list[int]], groups: list[PrefixGroup]) -> list[float]:
        """Scores of the groups' rows, in group order, on their shared prefixes (:func:`forward_on_shared_prefixes`)."""
        return _probabilities(forward_on_shared_prefixes(self.model, sequences, groups,
                                                         self.tokenizer.pad_token_id).suffix.logits)

    def _forward(self, input_ids, attention_mask) -> list[float]:
        """``sigmoid`` of the logit the model pools at each row's last non-pad token."""
        device = next(self.model.parameters()).device
        logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        return _probabilities(logits)


def _probabilities(logits) -> list[float]:
    """P(success) per row of the score head's ``[rows, 1]`` logits."""
    import torch

    return torch.sigmoid(logits.float().squeeze(-1)).tolist()


def prm_model_config(model_settings: dict, prm_settings: dict, adapter_dir: str | None = None,
                     cache_dir: str | None = None) -> ModelConfig:
    """The PRM's base (``prm.base_model``, else ``model.spec``) with the ``model`` section's loading settings."""
    return ModelConfig.from_dict({**model_settings, "spec": prm_settings["base_model"] or model_settings["spec"],
                                  "adapter": adapter_dir, "cache_dir": cache_dir})


class ProbeScorer(PRMScorer):
    """P(success) from a probe PRM (``prm.kind: probe``, :mod:`clemprm.models.probe`): this class's text, batching
    and counters, with :meth:`score_ids` reading the frozen policy's hidden-state features into the probe's heads
    instead of a classifier's logit."""

    def __init__(self, features: ProbeFeatures, head: ProbeHead, *, input: str = "candidate", max_length: int = 1024):
        super().__init__(features.cfg, input=input, max_length=max_length, token_budget=features.token_budget,
                         tokenizer=features.tokenizer, model=features.model, share_prefixes=False)
        self.features, self.head = features, head

    def score_ids(self, sequences: list[list[int]], keys: list | None = None) -> list[float]:
        """P(success) of already encoded pairs; the pairs of one key read their common token prefix once
        (:class:`~clemprm.models.probe.ProbeFeatures`)."""
        import torch

        if not sequences:
            return []
        with torch.inference_mode():
            return torch.sigmoid(self.head.logits(self.features.of(sequences, keys))).tolist()


def load_prm(model_settings: dict, prm_settings: dict, adapter_dir: str, cache_dir: str | None = None) -> PRMScorer:
    """The trained PRM of ``adapter_dir`` as a scorer, from the config's ``model`` and ``prm`` sections: a LoRA
    classifier, or (``prm.kind: probe``) a probe on the policy its folder names."""
    if prm_settings.get("kind", "lora") == "probe":
        config = read_probe_config(adapter_dir)
        cfg = policy_model_config({**model_settings, "spec": config["policy"]["spec"]}, {},
                                  config["policy"]["sft_adapter"], cache_dir)
        tokenizer, model = load_tokenizer_and_model(cfg, for_training=False)
        features = ProbeFeatures(cfg, tokenizer, model, config["layers"], config["window"],
                                 prm_settings["score_batch_tokens"])
        return ProbeScorer(features, ProbeHead.load(adapter_dir, config["combination"]), input=config["input"],
                           max_length=config["max_length"])
    cfg = prm_model_config(model_settings, prm_settings, adapter_dir, cache_dir)
    return PRMScorer(cfg, input=prm_settings["input"], max_length=prm_settings["max_length"],
                     token_budget=prm_settings["score_batch_tokens"])
