"""What ``tightfit train`` trains a model for: a module around it whose forward returns the
loss, so that the training fit plans (and the step measures) the whole step, the loss's
own activations included.

- an encoder: SimCSE's unsupervised objective (Gao et al., 2021), how sentence encoders
  such as the built-in one are tuned without labels: each sentence is embedded twice, the
  two views differing by dropout, and each must be nearer its own other view than the
  batch's other sentences (cross-entropy over cosine similarities at temperature 0.05);
- a causal LM: next-token cross-entropy over the prompt (``labels = input_ids``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tightfit.kinds import CAUSAL_LM, ENCODER

__all__ = ["OBJECTIVES", "CausalLMLoss", "ContrastiveLoss", "objective_for"]

#: SimCSE's temperature.
TEMPERATURE = 0.05


class ContrastiveLoss(nn.Module):
    """SimCSE: two dropout views of each sentence's mean-pooled embedding; the loss is the
    cross-entropy of each view's cosine similarities against the other views, its own the target."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        first, second = self._embed(input_ids, attention_mask), self._embed(input_ids, attention_mask)
        scores = first @ second.T / TEMPERATURE
        return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))


class CausalLMLoss(nn.Module):
    """The model's own next-token loss over its input (``labels = input_ids``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False).loss


#: The objective of each model kind ``tightfit train`` trains.
OBJECTIVES = {ENCODER: ContrastiveLoss, CAUSAL_LM: CausalLMLoss}


def objective_for(model: nn.Module, kind: str) -> nn.Module:
    """``model`` inside its kind's objective, in training mode (dropout on)."""
    if kind not in OBJECTIVES:
        raise ValueError(f"tightfit train trains {' and '.join(OBJECTIVES)} models; this folder holds a {kind} model")
    return OBJECTIVES[kind](model).train()
