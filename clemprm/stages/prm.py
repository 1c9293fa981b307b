"""The process reward model: the ``prm_adapter`` stage (training) and :class:`PRMScorer` (scoring, every later stage).

Model
    ``AutoModelForSequenceClassification(num_labels=1)`` on ``prm.base_model`` (null: the policy's ``model.spec``),
    loaded by the one model loader with the ``model`` section's settings (``quantization: auto`` = 4-bit NF4 on
    CUDA), plus a PEFT LoRA adapter (``task_type="SEQ_CLS"``: the ``score`` head is trained in full and saved
    with the adapter). The output is ``sigmoid(logit)`` = P(success | prefix + candidate). The policy's own
    ``model.adapter`` never applies to the PRM.

Text of a pair
    One function, :func:`pair_text`, for training and scoring: the prefix messages with consecutive same-role
    messages merged (as the clemcore backends send them) plus ``{"role": "assistant", "content": candidate}``,
    rendered by the chat template without a generation prompt (``chat_template_kwargs`` included). A text longer
    than ``max_length`` tokens keeps its end (the candidate and the most recent context). Sequence
    classification pools the last non-pad token, so the loader gives the tokenizer a pad token that differs from
    the end-of-turn token, and batches are padded on the right (recurrent layers such as Qwen3.5's Gated DeltaNet
    never see padding before a real token).

Shared prefixes
    The search and the evaluation score N candidates of one prefix. :meth:`PRMScorer.score` groups the pairs with
    the same prefix messages, takes the longest token prefix common to a group's sequences (robust to template and
    tokenizer boundaries; a left-truncated sequence starts elsewhere and then shares little or nothing), runs these
    prefixes once, left padded, into a cache, copies each cache row to its group's pairs and runs only the
    candidates' suffixes, padded on the right, attending to prefix + suffix. Left padding is exact for plain
    attention (masked) and for Qwen3.5's Gated DeltaNet layers (padded positions are zeroed before they reach the
    conv and recurrent states, which therefore stay zero until the first real token). A model whose cache holds
    anything else scores every pair in full (decided when the scorer is made, logged once).

Training
    Soft labels (``results/labels/soft_labels.parquet``, :data:`clemprm.records.SOFT_LABELS`), one example per
    branch point. A ``transformers.Trainer`` whose loss is BCE with logits on the squeezed logit (``prm.loss: mse``:
    squared error of ``sigmoid(logit)``), plus, with ``prm.pairwise_weight`` > 0, that weight times a logistic
    pairwise loss among siblings (:func:`pairwise_loss`; the siblings of a state then share a micro-batch and
    ``batch_size`` counts states), linear schedule with warmup, effective batch ``batch_size x grad_accum``,
    at most ``prm.epochs`` epochs with early stopping on a held-out slice of *instances*
    ``(game, experiment, game_id)``; the best epoch's adapter is the one written. ``prm.max_examples`` samples
    whole sibling groups, so that no state loses some of its siblings. CUDA: bf16, gradient
    checkpointing, paged 8-bit AdamW; CPU: fp32, ``adamw_torch``.

Metrics
    On both sides, from the written model through the scorer: BCE, MSE, Pearson and Spearman correlation with
    the labels, AUROC of ``label > 0.5`` (null when one class is missing), a 10-bin calibration table; and the
    same for two baselines that know no candidate: the train-side mean label, and the train-side mean label of
    the candidate's game. A PRM that only beats the first has learned "which game is this", not "which move".
    On the ranked side also two baselines that read the candidate (its length, the SFT policy's mean token
    log-probability of it: correlations and AUROC), and ``ranking``: what a search needs, the within-prefix
    pairwise accuracy and top-1 regret among siblings (``branch_points.siblings``) of the PRM and every baseline,
    with bootstrap intervals over instances (``prm.bootstrap_samples``, ``prm.ci``). The ranked side is
    ``heldout``, the branch points of validation-split instances (``branch_points.validation_instances``), which
    neither training nor the choice of epoch sees; without them it is the ``validation`` slice of train instances
    (``prm.validation_fraction``), which also chose the epoch.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from clemprm import records
from clemprm.models.loader import ModelConfig, load_tokenizer_and_model, resolve_dtype, resolve_quantization
from clemprm.stages.sft import (OPTIMIZER_AUTO, _finite, device_name, epoch_history, finish_metrics,
                                keep_4bit_differentiable, lora_config, normalise, progress_callback, save_adapter,
                                split_instances)

log = logging.getLogger(__name__)

LOSSES = ("bce", "mse")
CALIBRATION_BINS = 10
EPSILON = 1e-7          # probabilities are clipped to [EPSILON, 1 - EPSILON] for the BCE of predictions
MIN_SHARED_TOKENS = 16  # a shorter common prefix is not worth a forward pass of its own


# ------------------------------------------------------------------------------------------ pair text


def pair_text(tokenizer, prefix: list[dict], candidate: str, chat_template_kwargs: dict | None = None) -> str:
    """THE text the PRM reads for ``(prefix, candidate)``, in training and in scoring."""
    messages = normalise(list(prefix) + [{"role": "assistant", "content": candidate}])
    return tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False,
                                         **(chat_template_kwargs or {}))


def encode_pair(tokenizer, prefix: list[dict], candidate: str, chat_template_kwargs: dict | None,
                max_length: int) -> tuple[list[int], bool]:
    """The token ids of :func:`pair_text` truncated from the left (its last ``max_length`` tokens: the candidate
    and the most recent context), and whether anything was cut."""
    text = pair_text(tokenizer, prefix, candidate, chat_template_kwargs)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_length:], len(ids) > max_length


def _pad(sequences: list[list[int]], pad_id: int, left: bool):
    import torch

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        columns = slice(width - len(ids), width) if left else slice(0, len(ids))
        input_ids[row, columns] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, columns] = 1
    return input_ids, attention_mask


def pad_right(sequences: list[list[int]], pad_id: int):
    """``(input_ids, attention_mask)`` tensors, padded on the right."""
    return _pad(sequences, pad_id, left=False)


def pad_left(sequences: list[list[int]], pad_id: int):
    """``(input_ids, attention_mask)`` tensors, padded on the left: shared prefixes of different lengths all end in
    the last column, which their pairs' suffixes continue."""
    return _pad(sequences, pad_id, left=True)


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped longest first into batches of at most ``token_budget`` padded tokens (a longer row alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


# ---------------------------------------------------------------------------------------- shared prefixes


@dataclass
class PrefixGroup:
    """Pairs (``rows``) whose sequences share their first ``shared`` tokens; ``longest``: their longest sequence."""

    shared: int
    rows: list[int]
    longest: int


def common_prefix_length(sequences: list[list[int]]) -> int:
    """How many first tokens all ``sequences`` share, at most the shortest length minus one: every pair keeps a
    token of its own, at which its score is pooled."""
    limit = min(len(ids) for ids in sequences) - 1
    first = sequences[0]
    n = 0
    while n < limit and all(ids[n] == first[n] for ids in sequences[1:]):
        n += 1
    return n


def shared_prefix_groups(sequences: list[list[int]], keys: list | None) -> tuple[list[PrefixGroup], list[int]]:
    """``(groups, alone)``: the pairs of one key (e.g. the same prefix messages) that share at least
    :data:`MIN_SHARED_TOKENS` first tokens form a group; every other pair (no keys, its key's only pair, a group
    whose left truncation shifted a start) is scored alone."""
    if keys is None:
        return [], list(range(len(sequences)))
    by_key = collections.defaultdict(list)
    for i, key in enumerate(keys):
        by_key[key].append(i)
    groups, alone = [], []
    for rows in by_key.values():
        shared = common_prefix_length([sequences[i] for i in rows]) if len(rows) > 1 else 0
        if shared >= MIN_SHARED_TOKENS:
            groups.append(PrefixGroup(shared, rows, max(len(sequences[i]) for i in rows)))
        else:
            alone.extend(rows)
    return groups, sorted(alone)


def _padded_tokens(groups: list[PrefixGroup]) -> int:
    """Padded tokens of the larger of a micro-batch's two passes: the prefixes and the suffixes."""
    prefixes = len(groups) * max(group.shared for group in groups)
    suffixes = sum(len(group.rows) for group in groups) * max(group.longest - group.shared for group in groups)
    return max(prefixes, suffixes)


def group_batches(groups: list[PrefixGroup], token_budget: int) -> list[list[PrefixGroup]]:
    """Groups, longest shared prefix first, in micro-batches whose passes stay within ``token_budget`` padded tokens
    (a larger group alone)."""
    batches, current = [], []
    for group in sorted(groups, key=lambda g: -g.shared):
        if current and _padded_tokens(current + [group]) > token_budget:
            batches.append(current)
            current = []
        current.append(group)
    return batches + [current] if current else batches


def forward_on_shared_prefixes(model, sequences: list[list[int]], groups: list[PrefixGroup], pad_id: int,
                               **prefix_kwargs):
    """The model's output for the groups' rows (in group order) computed on their shared prefixes: the prefixes
    in one left-padded pass that fills a cache, its rows copied to their groups' pairs, then the suffixes (padded
    on the right) on top of it. Returns ``(output of the suffix pass, suffix ids)``; ``prefix_kwargs`` go to the
    prefix pass only (e.g. ``logits_to_keep=1``: its output is not used)."""
    import torch
    from transformers.cache_utils import DynamicCache

    device = next(model.parameters()).device
    prefix_ids, prefix_mask = pad_left([sequences[group.rows[0]][:group.shared] for group in groups], pad_id)
    cache = DynamicCache(config=model.config)
    with_cache = {cache_keyword(model): cache, "use_cache": True}
    model(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device),
          position_ids=(prefix_mask.cumsum(-1) - 1).clamp_min(0).to(device), **with_cache, **prefix_kwargs)
    owner = torch.tensor([k for k, group in enumerate(groups) for _ in group.rows])
    cache.reorder_cache(owner.to(device))
    suffix_ids, suffix_mask = pad_right([sequences[i][group.shared:] for group in groups for i in group.rows], pad_id)
    start = torch.tensor([group.shared for group in groups for _ in group.rows])
    positions = start.unsqueeze(-1) + torch.arange(suffix_ids.shape[1])
    attention_mask = torch.cat([prefix_mask[owner], suffix_mask], dim=-1)
    output = model(input_ids=suffix_ids.to(device), attention_mask=attention_mask.to(device),
                   position_ids=positions.to(device), **with_cache)
    return output, suffix_ids


def cache_keyword(model) -> str | None:
    """The name under which the model's forward takes a cache (``cache`` in transformers 5, else
    ``past_key_values``); None if it takes none."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(type(base).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def prefix_sharing_problem(model) -> str | None:
    """Why ``model`` cannot score suffixes on the cache of a left-padded shared prefix; None when it can: its
    cache is made of plain attention layers and linear-attention (conv + recurrent state) layers only. Sliding
    windows, static, quantized or other layers keep full scoring."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

    if cache_keyword(model) is None:
        return "its forward takes no cache"
    try:
        cache = DynamicCache(config=model.config)
    except Exception as error:  # a config the layer-type dispatch does not know
        return f"no cache for its config ({type(error).__name__}: {error})"
    unsupported = sorted({type(layer).__name__ for layer in cache.layers
                          if type(layer) not in (DynamicLayer, LinearAttentionLayer)})
    if not cache.layers or unsupported:
        return f"cache layers {', '.join(unsupported) or 'unknown'}"
    return None


# --------------------------------------------------------------------------------------------- scorer


@dataclass
class PRMStats:
    """Running counters of a :class:`PRMScorer` (also readable as ``stats["pairs"]``)."""

    calls: int = 0
    pairs: int = 0
    tokens: int = 0
    truncated: int = 0
    shared_tokens: int = 0      # prefix tokens computed once for several pairs instead of once per pair
    seconds: float = 0.0

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PRMScorer:
    """P(success) of ``(prefix messages, candidate)`` pairs from the PRM (base + adapter ``cfg.adapter``).

    ``token_budget`` (default ``cfg.token_budget``) bounds the padded tokens of one forward pass; pairs are
    sorted by length so a micro-batch holds similar lengths. With ``share_prefixes`` (where the model's cache
    allows it) the token prefix common to the pairs of one prefix is computed once. A score does not depend on
    the batch it is in nor on sharing (up to float rounding)."""

    def __init__(self, cfg: ModelConfig, *, max_length: int = 1024, token_budget: int | None = None, tokenizer=None,
                 model=None, share_prefixes: bool = True):
        self.cfg = cfg
        if model is None or tokenizer is None:
            tokenizer, model = load_tokenizer_and_model(cfg, for_training=False, task="seq-cls")
        self.tokenizer, self.model = tokenizer, model
        self.max_length = int(max_length)
        self.token_budget = int(token_budget or cfg.token_budget)
        self.stats = PRMStats()
        self.share_prefixes = share_prefixes
        if share_prefixes and (problem := prefix_sharing_problem(model)):
            log.info("prm %s: every pair scored in full, without shared prefixes: %s", cfg.short_name, problem)
            self.share_prefixes = False

    def score(self, pairs: list[tuple[list[dict], str]]) -> list[float]:
        """P(success) for each (prefix messages, candidate answer); pairs with the same prefix messages share their
        common token prefix; length-sorted micro-batches under a token budget, left truncation."""
        start = time.perf_counter()
        sequences = []
        for prefix, candidate in pairs:
            ids, truncated = encode_pair(self.tokenizer, prefix, candidate, self.cfg.chat_template_kwargs,
                                         self.max_length)
            sequences.append(ids)
            self.stats.truncated += truncated
        scores = self.score_ids(sequences, keys=[json.dumps(prefix, sort_keys=True, default=str)
                                                 for prefix, _ in pairs])
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
        output, _ = forward_on_shared_prefixes(self.model, sequences, groups, self.tokenizer.pad_token_id)
        return _probabilities(output.logits)

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


def load_prm(model_settings: dict, prm_settings: dict, adapter_dir: str, cache_dir: str | None = None) -> PRMScorer:
    """The trained PRM of ``adapter_dir`` as a scorer, from the config's ``model`` and ``prm`` sections."""
    cfg = prm_model_config(model_settings, prm_settings, adapter_dir, cache_dir)
    return PRMScorer(cfg, max_length=prm_settings["max_length"], token_budget=prm_settings["score_batch_tokens"])


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Example:
    """One branch point: the encoded pair, its soft label and its instance ``(game, experiment, game_id)``."""

    input_ids: list[int]
    truncated: bool
    label: float
    key: tuple[str, str, str]
    prefix_id: str = ""      # the state the candidate answers: siblings (branch_points.siblings) share it
    row: int = -1            # index of its soft-label row


def instance_key(row: dict) -> tuple[str, str, str]:
    return str(row["game"]), str(row["experiment"]), str(row["game_id"])


def read_labels(path: str | Path) -> list[dict]:
    """The soft-label rows; an unreadable file or a label outside [0, 1] is an error naming the file."""
    rows = records.read_records(path, records.SOFT_LABELS)
    for i, row in enumerate(rows):
        label = row["label"]
        if label is None or not 0.0 <= label <= 1.0:   # NaN fails both comparisons
            raise records.RecordFileError(f"record file {path}, row {i} ({row['bp_id']}): label {label!r} is not "
                                          f"in [0, 1]")
    return rows


def indices_by_prefix(examples: list[Example]) -> list[list[int]]:
    """The indices of the examples grouped by ``prefix_id`` (the siblings of one state), groups in order of first
    appearance."""
    groups = collections.defaultdict(list)
    for index, example in enumerate(examples):
        groups[example.prefix_id].append(index)
    return list(groups.values())


def sibling_groups(examples: list[Example]) -> list[list[Example]]:
    """The examples grouped by ``prefix_id``, groups in order of first appearance."""
    return [[examples[i] for i in group] for group in indices_by_prefix(examples)]


def sample_whole_groups(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    """At most ``limit`` examples (all when None) made of whole sibling groups: the groups in an order drawn by
    ``seed``, each taken while it fits (a pair-wise draw would split states and lose the pairs the ranking metrics
    and the pairwise loss compare)."""
    if limit is None or len(examples) <= limit:
        return examples
    groups = sibling_groups(examples)
    chosen, total = [], 0
    for group in random.Random(seed).sample(groups, len(groups)):
        if total + len(group) <= limit:
            chosen.extend(group)
            total += len(group)
    return chosen


def build_examples(rows: list[dict], tokenizer, chat_template_kwargs: dict, max_length: int) -> list[Example]:
    return [Example(*encode_pair(tokenizer, row["prefix"], row["candidate"], chat_template_kwargs, max_length),
                    label=float(row["label"]), key=instance_key(row), prefix_id=row.get("prefix_id") or row["bp_id"],
                    row=index) for index, row in enumerate(rows)]


# ------------------------------------------------------------------------------------------- metrics


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation; None when either side is constant (or there are fewer than two points)."""
    if len(x) < 2 or min(x) == max(x) or min(y) == max(y):
        return None
    mx, my = _mean(x), _mean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return _finite(sxy / math.sqrt(sxx * syy))


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            result[i] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(x: list[float], y: list[float]) -> float | None:
    return pearson(ranks(x), ranks(y))


def auroc(predictions: list[float], labels: list[float]) -> float | None:
    """AUROC of the predictions for ``label > 0.5`` (Mann-Whitney, ties count half); None when a class is missing."""
    positive = [label > 0.5 for label in labels]
    n_positive = sum(positive)
    n_negative = len(labels) - n_positive
    if not n_positive or not n_negative:
        return None
    rank_sum = sum(rank for rank, is_positive in zip(ranks(predictions), positive) if is_positive)
    return (rank_sum - n_positive * (n_positive + 1) / 2) / (n_positive * n_negative)


def calibration(predictions: list[float], labels: list[float], bins: int = CALIBRATION_BINS) -> list[dict]:
    """Equal-width prediction bins over [0, 1]: count, mean prediction and mean label (null when empty)."""
    members = collections.defaultdict(list)
    for prediction, label in zip(predictions, labels):
        members[min(bins - 1, int(prediction * bins))].append((prediction, label))
    return [{"bin": [round(b / bins, 6), round((b + 1) / bins, 6)], "count": len(members[b]),
             "mean_prediction": _mean(p for p, _ in members[b]), "mean_label": _mean(y for _, y in members[b])}
            for b in range(bins)]


def prediction_metrics(predictions: list[float], labels: list[float]) -> dict | None:
    """BCE, MSE, correlations, AUROC and calibration of probabilities against soft labels; None without data."""
    if not labels:
        return None
    clipped = [min(1 - EPSILON, max(EPSILON, p)) for p in predictions]
    return {
        "n": len(labels), "mean_label": _mean(labels), "mean_prediction": _mean(predictions),
        "bce": _mean(-(y * math.log(p) + (1 - y) * math.log(1 - p)) for p, y in zip(clipped, labels)),
        "mse": _mean((p - y) ** 2 for p, y in zip(predictions, labels)),
        "pearson": pearson(predictions, labels), "spearman": spearman(predictions, labels),
        "auroc": auroc(predictions, labels), "calibration": calibration(predictions, labels),
    }


def baseline_metrics(train: list[Example], sides: dict[str, list[Example]]) -> dict:
    """The two candidate-blind baselines on every side: the train-side mean label, and the train-side mean label
    of the example's game (the overall mean for a game the train side lacks)."""
    overall = _mean(e.label for e in train)
    by_game = collections.defaultdict(list)
    for example in train:
        by_game[example.key[0]].append(example.label)
    game_means = {game: _mean(labels) for game, labels in sorted(by_game.items())}
    predict = {"constant_mean": lambda e: overall, "game_mean": lambda e: game_means.get(e.key[0], overall)}
    baselines = {}
    for name, rule in predict.items():
        baselines[name] = {side: prediction_metrics([rule(e) for e in examples], [e.label for e in examples])
                           for side, examples in sides.items()}
    baselines["constant_mean"]["value"] = overall
    baselines["game_mean"]["values"] = game_means
    return baselines


def rank_metrics(scores: list[float], labels: list[float]) -> dict | None:
    """The scale-free part of :func:`prediction_metrics`, for scores that are no probabilities (a length, a
    log-probability): correlations with the labels and AUROC of ``label > 0.5``."""
    if not labels:
        return None
    return {"n": len(labels), "pearson": pearson(scores, labels), "spearman": spearman(scores, labels),
            "auroc": auroc(scores, labels)}


def sibling_statistics(scores: list[float], labels: list[float]) -> tuple[float, int, float]:
    """``(concordant, pairs, regret)`` of one prefix's siblings: over the sibling pairs with different labels,
    1 when the higher-labelled one scores higher, 1/2 on a score tie; and the best label minus the label of the
    pick, the top score (ties: their mean label, what a random tie-break picks on average)."""
    concordant, pairs = 0.0, 0
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            if labels[i] != labels[j]:
                pairs += 1
                agree = (scores[i] - scores[j]) * (labels[i] - labels[j])
                concordant += 1.0 if agree > 0 else 0.5 if scores[i] == scores[j] else 0.0
    top = max(scores)
    picked = [label for score, label in zip(scores, labels) if score == top]
    return concordant, pairs, max(labels) - sum(picked) / len(picked)


def prefix_groups(examples: list[Example]) -> list[list[int]]:
    """The indices of the examples of each prefix with two or more siblings."""
    return [indices for indices in indices_by_prefix(examples) if len(indices) > 1]


def orientation(examples: list[Example], scores: list[float]) -> int:
    """-1 where ``scores`` rank the siblings of ``examples`` (the train side) worse than chance, else 1: a
    candidate-aware baseline (length, the policy's log-probability) is read the way round its train side supports
    ("shorter is better" is a baseline too), so the PRM is measured against its stronger reading."""
    concordant = pairs = 0
    for group in prefix_groups(examples):
        group_concordant, group_pairs, _ = sibling_statistics([scores[i] for i in group],
                                                              [examples[i].label for i in group])
        concordant, pairs = concordant + group_concordant, pairs + group_pairs
    return -1 if pairs and concordant < pairs / 2 else 1


def ranking_metrics(examples: list[Example], scorers: dict[str, list[float]], samples: int, seed: int,
                    ci: float) -> dict:
    """What a search needs of a scorer, on the prefixes of ``examples`` with two or more siblings: within-prefix
    pairwise accuracy (among siblings with different labels), top-1 regret and the mean label of the pick (next
    to ``best_label``, the mean label of the best sibling), overall (pooled over prefixes) and
    per game, with percentile bootstrap intervals over instances resampled within each game (the helpers of
    :mod:`clemprm.evaluation.evaluate`; the same draws for every scorer, so their intervals compare on equal terms)."""
    import numpy as np
    import pandas as pd

    from clemprm.evaluation.evaluate import OVERALL, bootstrap_weights, interval

    groups = prefix_groups(examples)
    instances = sorted({examples[g[0]].key for g in groups})
    games = sorted({key[0] for key in instances})
    result = {"prefixes": len(groups), "siblings": sum(map(len, groups)), "instances": len(instances),
              "pairs_with_different_labels": sum(sibling_statistics([0.0] * len(g), [examples[i].label for i in g])[1]
                                                 for g in groups),
              "best_label": {}, "scorers": {}}
    if not groups:
        return result
    tables = {game: pd.DataFrame(index=[key for key in instances if key[0] == game]) for game in games}
    weights = bootstrap_weights(tables, samples, seed)
    members_of = [(game, [game]) for game in games] + [(OVERALL, games)]
    for name, scores in scorers.items():
        # per game, per instance: concordant, pairs, regret sum, prefixes, best-label sum
        sums = {game: np.zeros((len(table), 5)) for game, table in tables.items()}
        for g in groups:
            key = examples[g[0]].key
            labels = [examples[i].label for i in g]
            concordant, pairs, regret = sibling_statistics([scores[i] for i in g], labels)
            sums[key[0]][tables[key[0]].index.get_loc(key)] += (concordant, pairs, regret, 1, max(labels))
        entry = {}
        for group, members in members_of:
            point = sum(sums[game].sum(axis=0) for game in members)
            draws = sum(weights[game] @ sums[game] for game in members)
            with np.errstate(invalid="ignore", divide="ignore"):
                entry[group] = {
                    "pairwise_accuracy": interval(point[0] / point[1] if point[1] else math.nan,
                                                  draws[:, 0] / draws[:, 1], ci),
                    "top1_regret": interval(point[2] / point[3], draws[:, 2] / draws[:, 3], ci),
                    # the mean label of the sibling this scorer picks (best label minus regret)
                    "pick_label": interval((point[4] - point[2]) / point[3], (draws[:, 4] - draws[:, 2]) / draws[:, 3],
                                           ci),
                    "pairs": int(point[1]), "prefixes": int(point[3])}
                result["best_label"][group] = interval(point[4] / point[3], draws[:, 4] / draws[:, 3], ci)
        result["scorers"][name] = entry
    return result


# ------------------------------------------------------------------------------------------ training


def effective_grad_accum(batch_size: int, grad_accum: int, n_train: int) -> int:
    """``grad_accum``, capped at the batches of one epoch so that every epoch makes at least one optimizer step."""
    return max(1, min(grad_accum, math.ceil(n_train / batch_size)))


def _training_args(prm: dict, seed: int, output_dir: str, device: str, dtype, grad_accum: int,
                   has_validation: bool):
    import torch
    from transformers import TrainingArguments

    per_epoch = {"eval_strategy": "epoch", "save_strategy": "epoch", "load_best_model_at_end": True,
                 "metric_for_best_model": "eval_loss", "greater_is_better": False, "save_total_limit": 1,
                 "save_only_model": True} if has_validation else {"eval_strategy": "no", "save_strategy": "no"}
    checkpointing = device == "cuda"
    return TrainingArguments(
        output_dir=output_dir, seed=seed, data_seed=seed,
        learning_rate=prm["lr"], num_train_epochs=prm["epochs"], lr_scheduler_type=prm["scheduler"],
        warmup_steps=prm["warmup_ratio"], weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=prm["batch_size"], per_device_eval_batch_size=prm["batch_size"],
        gradient_accumulation_steps=grad_accum, optim=OPTIMIZER_AUTO[device],
        bf16=device == "cuda" and dtype == torch.bfloat16, fp16=device == "cuda" and dtype == torch.float16,
        activation_checkpointing=checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        train_sampling_strategy="group_by_length", label_names=["labels"], remove_unused_columns=False,
        logging_strategy="steps", logging_steps=1, report_to="none", disable_tqdm=True,
        dataloader_pin_memory=device == "cuda", **per_epoch)


def pairwise_loss(logits, labels, groups):
    """The logistic pairwise loss among siblings: over every pair of one group (``groups``: a state's index per
    row) whose labels differ, ``softplus(-(logit_higher - logit_lower))`` weighted by the label gap (a pair that
    differs by one continuation of K counts 1/K of a win-against-loss pair), averaged over those pairs; 0 when
    the batch has none. Only the ordering of siblings enters, not the level of a state, which BCE fits."""
    import torch.nn.functional as F

    gap = labels.unsqueeze(1) - labels.unsqueeze(0)
    pairs = (groups.unsqueeze(1) == groups.unsqueeze(0)) & (gap > 0)
    if not pairs.any():
        return logits.sum() * 0.0
    margins = logits.unsqueeze(1) - logits.unsqueeze(0)
    return (gap[pairs] * F.softplus(-margins[pairs])).mean()


def prm_loss(logits, labels, groups, loss: str, pairwise_weight: float):
    """The training loss of a micro-batch: BCE with logits against the soft labels (``mse``: squared error of the
    sigmoid), plus ``pairwise_weight`` x :func:`pairwise_loss` among the siblings of ``groups``."""
    import torch.nn.functional as F

    labels = labels.float()
    if loss == "mse":
        pointwise = F.mse_loss(logits.sigmoid(), labels)
    else:
        pointwise = F.binary_cross_entropy_with_logits(logits, labels)
    if not pairwise_weight:
        return pointwise
    return pointwise + pairwise_weight * pairwise_loss(logits, labels, groups)


def _trainer_class():
    from transformers import Trainer

    class PRMTrainer(Trainer):
        """A Trainer whose loss is :func:`prm_loss` of the one logit. The loss is a micro-batch mean: the Trainer
        divides it by the accumulation steps."""

        loss_is_scaled_for_ga = False

        def __init__(self, *args, loss: str = "bce", pairwise_weight: float = 0.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss = loss
            self.pairwise_weight = pairwise_weight

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            groups = inputs.pop("groups")
            outputs = model(**inputs)
            loss = prm_loss(outputs.logits.squeeze(-1).float(), labels, groups, self.loss, self.pairwise_weight)
            return (loss, outputs) if return_outputs else loss

    return PRMTrainer


def _collator(pad_id: int):
    """Batches of dataset rows (:func:`_as_dataset`), each one sibling group or one pair, flattened into pairs;
    ``groups`` holds each pair's row in the batch."""
    import torch

    def collate(batch: list[dict]) -> dict:
        sequences = [ids for row in batch for ids in row["input_ids"]]
        input_ids, attention_mask = pad_right(sequences, pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": torch.tensor([label for row in batch for label in row["labels"]], dtype=torch.float32),
                "groups": torch.tensor([i for i, row in enumerate(batch) for _ in row["labels"]])}

    return collate


def _as_dataset(examples: list[Example], by_state: bool):
    """One row per pair, or (``by_state``: the pairwise loss needs a state's siblings in one micro-batch) one row
    per sibling group; ``length`` (its tokens) lets the Trainer group rows of similar lengths."""
    from datasets import Dataset

    groups = sibling_groups(examples) if by_state else [[e] for e in examples]
    return Dataset.from_dict({"input_ids": [[e.input_ids for e in group] for group in groups],
                              "labels": [[e.label for e in group] for group in groups],
                              "length": [sum(len(e.input_ids) for e in group) for group in groups]})


def _train(model, tokenizer, prm: dict, seed: int, train: list[Example], validation: list[Example], output_dir: str,
           device: str, dtype) -> tuple[object, dict]:
    """Train the PEFT model; return it (the best epoch's weights when there is a validation side) and the
    training part of the metrics."""
    from transformers import EarlyStoppingCallback, PrinterCallback

    by_state = prm["pairwise_weight"] > 0
    train_rows = len(sibling_groups(train)) if by_state else len(train)
    grad_accum = effective_grad_accum(prm["batch_size"], prm["grad_accum"], train_rows)
    if grad_accum < prm["grad_accum"]:
        log.info("prm: %d train %s make %d batches of %d: gradient accumulation capped at %d (of %d) so that "
                 "every epoch makes an optimizer step", train_rows, "states" if by_state else "pairs",
                 math.ceil(train_rows / prm["batch_size"]), prm["batch_size"], grad_accum, prm["grad_accum"])
    args = _training_args(prm, seed, output_dir, device, dtype, grad_accum, has_validation=bool(validation))
    callbacks = [progress_callback("prm")]
    if validation:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=prm["early_stopping_patience"]))
    trainer = _trainer_class()(
        model=model, args=args, train_dataset=_as_dataset(train, by_state),
        eval_dataset=_as_dataset(validation, by_state) if validation else None,
        data_collator=_collator(tokenizer.pad_token_id), callbacks=callbacks, loss=prm["loss"],
        pairwise_weight=prm["pairwise_weight"])
    trainer.remove_callback(PrinterCallback)   # progress goes to the log through LogProgress
    initial = trainer.evaluate() if validation else None
    start = time.perf_counter()
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    state = trainer.state
    history = [{k: v for k, v in row.items() if "token_accuracy" not in k}
               for row in epoch_history(state.log_history, initial)]
    evals = [row for row in history if row.get("eval_loss") is not None and row["epoch"] > 0]
    best = min(evals, key=lambda row: row["eval_loss"]) if evals else (history[-1] if history else {})
    return trainer.model, {
        "status": "trained", "steps": state.global_step, "epochs_run": round(state.epoch or 0.0, 4),
        "max_epochs": prm["epochs"], "stopped_early": bool(validation) and (state.epoch or 0) < prm["epochs"] - 1e-6,
        "best_epoch": best.get("epoch"), "batch_size": prm["batch_size"], "grad_accum": grad_accum,
        "effective_batch": prm["batch_size"] * grad_accum, "optimizer": OPTIMIZER_AUTO[device], "bf16": args.bf16,
        "gradient_checkpointing": args.gradient_checkpointing, "train_loss": _finite(result.training_loss),
        "final_train_loss": history[-1].get("train_loss") if history else None, "eval_loss": best.get("eval_loss"),
        "initial_eval_loss": _finite(initial["eval_loss"]) if initial else None, "history": history,
        "train_seconds": round(train_seconds, 2)}


def orientation_side(train: list[Example]) -> list[Example]:
    """The examples the candidate-aware baselines are oriented on: the train side when it has siblings, else none
    (nothing to orient on; every baseline is then read as is)."""
    return train if prefix_groups(train) else []


def _evaluate(scorer: PRMScorer, sides: dict[str, list[Example]], ranked: str, rows: list[dict],
              policy_logprobs: dict[int, float], prm: dict, seed: int) -> dict:
    """Prediction metrics of the trained PRM and of the baselines, per side (None when empty); on the ``ranked``
    side (the held-out set when there is one, else the validation slice) also the candidate-aware baselines (the
    candidate's length in characters, the policy's mean token log-probability of it, ``policy_logprobs`` by row;
    each times its train-side :func:`orientation`) and every scorer's within-prefix ranking
    (:func:`ranking_metrics`; ``constant_mean`` ties all siblings: the expected pick of a random choice)."""
    evaluation, predictions = {}, {}
    for side, examples in sides.items():
        predictions[side] = scorer.score_ids([e.input_ids for e in examples]) if examples else []
        evaluation[side] = prediction_metrics(predictions[side], [e.label for e in examples])
    baselines = baseline_metrics(sides["train"], sides)
    examples = sides[ranked]
    labels = [e.label for e in examples]
    readers = {"candidate_length": lambda e: float(len(rows[e.row]["candidate"])),
               "policy_logprob": lambda e: policy_logprobs[e.row]}
    oriented_on = orientation_side(sides["train"])
    orientations = {name: orientation(oriented_on, [read(e) for e in oriented_on]) for name, read in readers.items()}
    candidate_scores = {name: [orientations[name] * read(e) for e in examples] for name, read in readers.items()}
    for name, scores in candidate_scores.items():
        baselines[name] = {ranked: rank_metrics(scores, labels), "orientation": orientations[name]}
    game_means = baselines["game_mean"]["values"]
    scorers = {"prm": predictions[ranked], "constant_mean": [0.0] * len(examples),
               "game_mean": [game_means.get(e.key[0], baselines["constant_mean"]["value"]) for e in examples],
               **candidate_scores}
    ranking = {"side": ranked, "orientation": orientations,
               **ranking_metrics(examples, scorers, prm["bootstrap_samples"], seed, prm["ci"])}
    return {"evaluation": evaluation, "baselines": baselines, "ranking": ranking}


def policy_logprobs_of(model_settings: dict, sft_adapter: str | None, rows: list[dict], examples: list[Example],
                       cache_dir: str | None) -> dict[int, float]:
    """The SFT policy's (the base policy's without ``sft_adapter``) mean token log-probability of each example's
    candidate after its prefix, by row (:func:`clemprm.search.logprob.mean_logprobs`); the policy is released
    after."""
    from clemprm.stages.labels import sft_policy_settings
    from clemprm.search.logprob import mean_logprobs
    from clemprm.stages.rollouts import load_policy

    if not examples:
        return {}
    policy = load_policy(sft_policy_settings(model_settings, sft_adapter), cache_dir)
    start = time.perf_counter()
    scores = mean_logprobs(policy, [(rows[e.row]["prefix"], rows[e.row]["candidate"]) for e in examples])
    log.info("prm: policy log-probabilities of %d candidates in %.0f s", len(examples),
             time.perf_counter() - start)
    del policy
    return {e.row: score for e, score in zip(examples, scores)}


def train_prm(settings: dict, labels_path: str, adapter_dir: str, metrics_path: str,
              cache_dir: str | None = None, sft_adapter: str | None = None) -> dict:
    """Train the PRM on the soft labels of ``labels_path``; write the adapter folder (LoRA + score head) and the
    metrics JSON; return the metrics. ``settings`` is the rule's params: seed, model, prm. ``sft_adapter``: the
    policy whose log-probabilities are a baseline (None: the base policy)."""
    import transformers
    from peft import get_peft_model

    import datasets
    datasets.disable_progress_bars()   # the rule log gets LogProgress lines instead

    start = time.perf_counter()
    prm, seed = settings["prm"], int(settings["seed"])
    if prm["loss"] not in LOSSES:
        raise ValueError(f"prm.loss must be one of {', '.join(LOSSES)}, got {prm['loss']!r}")
    rows = read_labels(labels_path)
    cfg = prm_model_config(settings["model"], prm, cache_dir=cache_dir)
    device = device_name()
    transformers.set_seed(seed)   # the new score head and the LoRA weights are initialised from it
    tokenizer, model = load_tokenizer_and_model(cfg, for_training=True, task="seq-cls")
    if device == "cpu":
        keep_4bit_differentiable(model)
    model = get_peft_model(model, lora_config(prm["lora"], "SEQ_CLS"))

    examples = build_examples(rows, tokenizer, cfg.chat_template_kwargs, prm["max_length"])
    heldout = [e for e in examples if rows[e.row]["split"] != "train"]   # branch_points.validation_instances
    train_side = [e for e in examples if rows[e.row]["split"] == "train"]
    validation_keys = split_instances([e.key for e in train_side], prm["validation_fraction"], seed)
    train = sample_whole_groups([e for e in train_side if e.key not in validation_keys], prm["max_examples"], seed)
    validation = sample_whole_groups([e for e in train_side if e.key in validation_keys], prm["max_examples"],
                                     seed + 1)
    heldout_keys = {e.key for e in heldout}
    log.info("prm data: %d branch points from %s (%d truncated to %d tokens); train %d pairs on %d instances, "
             "validation %d pairs on %d instances, held out %d pairs on %d validation-split instances", len(examples),
             labels_path, sum(e.truncated for e in examples), prm["max_length"], len(train),
             len({e.key for e in train}), len(validation), len(validation_keys), len(heldout), len(heldout_keys))
    metrics = {
        "model": {"spec": cfg.spec, "device": device, "quantization": resolve_quantization(cfg, device),
                  "dtype": str(resolve_dtype(cfg, device)), "pad_token": tokenizer.pad_token,
                  "eos_token": tokenizer.eos_token},
        "loss": prm["loss"], "pairwise_weight": prm["pairwise_weight"],
        "examples": {
            "rows": len(rows), "train": len(train), "validation": len(validation), "heldout": len(heldout),
            "train_available": sum(e.key not in validation_keys for e in train_side),
            "train_instances": len({e.key for e in train}), "validation_instances": len(validation_keys),
            "heldout_instances": len(heldout_keys),
            "validation_instance_keys": ["/".join(key) for key in sorted(validation_keys)],
            "train_by_game": dict(sorted(collections.Counter(e.key[0] for e in train).items())),
            "truncated": sum(e.truncated for e in examples)},
        "tokens": {"train": sum(len(e.input_ids) for e in train),
                   "validation": sum(len(e.input_ids) for e in validation),
                   "heldout": sum(len(e.input_ids) for e in heldout),
                   "max_sequence": max((len(e.input_ids) for e in examples), default=0)},
    }
    sides = {"train": train, "validation": validation, "heldout": heldout}
    ranked = "heldout" if heldout else "validation"

    adapter_dir, tmp_root = Path(adapter_dir), None
    adapter_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp_root = Path(tempfile.mkdtemp(prefix=f".{adapter_dir.name}.tmp-", dir=adapter_dir.parent))
        if train:
            model, training = _train(model, tokenizer, prm, seed, train, validation, str(tmp_root / "checkpoints"),
                                     device, resolve_dtype(cfg, device))
            metrics.update(training)
            scorer = PRMScorer(cfg, max_length=prm["max_length"], token_budget=prm["score_batch_tokens"],
                               tokenizer=tokenizer, model=model)
            logprobs = policy_logprobs_of(settings["model"], sft_adapter, rows,
                                          orientation_side(sides["train"]) + sides[ranked], cache_dir)
            metrics.update(_evaluate(scorer, sides, ranked, rows, logprobs, prm, seed))
        else:
            # no branch points: an untrained adapter (LoRA B = 0, a random score head) still lets the later
            # stages run; the metrics say so
            log.warning("prm: no training examples; writing an untrained adapter")
            metrics.update(status="untrained: no training examples", steps=0, epochs_run=0, train_loss=None,
                           eval_loss=None, history=[], evaluation=dict.fromkeys(sides),
                           baselines=None, ranking=None)
        save_adapter(model, cfg.spec, tmp_root, adapter_dir)
    finally:
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)
    finish_metrics(metrics, start, settings, metrics_path)
    ranked_metrics = (metrics["evaluation"] or {}).get(ranked) or {}
    log.info("prm: %s in %.0f s; %s steps, train loss %s, eval loss %s -> %s, %s AUROC %s, Pearson %s; "
             "adapter %s", metrics["status"], metrics["seconds"], metrics.get("steps"), metrics.get("train_loss"),
             metrics.get("initial_eval_loss"), metrics.get("eval_loss"), ranked, ranked_metrics.get("auroc"),
             ranked_metrics.get("pearson"), adapter_dir)
    return metrics
