"""The LoRA PRM's score head before and after training: fitted first on the frozen model's features (``prm.head_init:
probe``), and how far training moved it from its random start.

Linear probe, then fine-tune (Kumar et al., ICLR 2022): a head initialised at random, N(0, 0.02), sends random
gradients into the LoRA and, in the tens of steps a run affords, barely leaves its start (measured on the learning
benchmark: std 0.0199 and norm 0.48 after 36 steps, predictions spread 0.03 against the labels' 0.23). Fitting the head
on the frozen features first (the model with its LoRA at zero is the base model) gives the fine-tuning a head that
already ranks, at the cost of one forward pass over the train pairs. The fit is the probe PRM's
(:func:`clemprm.stages.probe.fit_linear`, the ridge strength chosen over ``prm.probe.l2`` by the probe's own
cross-validation over train instances), on the last token's final hidden state: what the score head reads.

The Llama-style score head has no bias, so the probe is fitted without one (features scaled, not centred): the
head then holds it exactly, level included.
"""

from __future__ import annotations

import logging
import time

from clemprm.models.scoring import pad_right
from clemprm.stages import probe
from clemprm.stages.prm_data import Example

log = logging.getLogger(__name__)

HEAD_INITS = ("random", "probe")   # prm.head_init


def head_parameters(model, suffix: str = "") -> list:
    """The trainable parameters of the modules PEFT trains in full (``modules_to_save``: the score head) whose names
    end with ``suffix``."""
    return [param for name, param in model.named_parameters()
            if param.requires_grad and "modules_to_save" in name and name.endswith(suffix)]


def score_head(model):
    """The one trainable weight of the score head PEFT trains in full (``modules_to_save``), ``[1, hidden]``."""
    weights = head_parameters(model, "weight")
    if len(weights) != 1:
        raise ValueError(f"the PRM model has {len(weights)} fully trained weight(s), expected the score head alone")
    return weights[0]


def last_token_features(model, examples: list[Example], pad_id: int, batch_size: int):
    """The input of the score head at each example's last token (what a sequence classifier pools), ``[n, hidden]``
    in example order, forward only in batches of ``batch_size`` sorted by length."""
    import torch

    head_module = next(module for name, module in model.named_modules() if name.endswith("modules_to_save.default"))
    captured = []
    hook = head_module.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    features = [None] * len(examples)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                input_ids, attention_mask = pad_right([examples[i].input_ids for i in batch], pad_id)
                captured.clear()
                model(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device))
                last = attention_mask.sum(1) - 1
                hidden = captured[-1].float().cpu()
                for row, i in enumerate(batch):
                    features[i] = hidden[row, last[row]]
    finally:
        hook.remove()
        model.train(was_training)
    return torch.stack(features)


def fit_head(model, examples: list[Example], weights: dict[int, float], prm: dict, seed: int, pad_id: int,
             objective) -> dict:
    """Set the score head of ``model`` (a PEFT sequence classifier whose LoRA is still zero) to a linear probe of its
    frozen features fitted on ``examples`` with ``objective`` (the PRM's loss) and the pair ``weights``; returns what
    was done for the training record (the ridge strength, what chose it, the cross-validation table, and in
    ``marks`` the warning of a choice at the edge of ``prm.probe.l2``)."""
    import torch

    start = time.perf_counter()
    features = last_token_features(model, examples, pad_id, prm["batch_size"])
    data = probe.FitData.of(examples, features, weights)
    # the score head has no bias: the folds' heads and the final one are fitted without one alike
    l2, table = probe.choose_l2(data, prm["probe"]["l2"], objective, prm["probe"]["folds"], seed, intercept=False)
    fitted = probe.fit_linear(data, l2, objective, intercept=False)
    head = score_head(model)
    with torch.no_grad():   # (x / std) @ w == x @ (w / std)
        head.copy_((fitted.weight / fitted.std).to(head.dtype).reshape(head.shape))
    seconds = time.perf_counter() - start
    log.info("prm: score head fitted on the frozen features of %d train examples in %.0f s (l2 %s)", len(examples),
             seconds, l2)
    criterion = probe.ranking_criterion(table) if table else None
    return {"l2": l2, "criterion": criterion, "cv": table, "examples": len(examples), "seconds": round(seconds, 2),
            "marks": probe.grid_edge_marks("the LoRA PRM's initial score head (prm.head_init probe)", l2,
                                           prm["probe"]["l2"], criterion) if table else []}


def head_movement(initial, final, lora_b: list) -> dict:
    """How far training moved the score head from its random start (``initial``, ``final``: its weight tensors),
    against the start's own scale, and the largest LoRA B entry (``lora_b``: their tensors; B starts at 0)."""
    change = (final - initial).float()
    return {"initial_std": round(float(initial.float().std()), 6), "initial_norm": round(float(initial.norm()), 6),
            "final_std": round(float(final.float().std()), 6), "change_norm": round(float(change.norm()), 6),
            "change_over_initial_norm": round(float(change.norm() / initial.float().norm()), 4),
            "lora_b_max_abs": round(max((float(b.detach().abs().max()) for b in lora_b), default=0.0), 6)}
