"""One stage's forward within a run, the same whether the next stage is another rank or the
next device of this process: what it takes (the token ids on the first stage, the hidden
states received after it), what it gives (hidden states; on a causal LM's last stage the
greedy next token; on an encoder's, the mean-pooled sentence embeddings), and its KV cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tightfit.app.generation import next_token
from tightfit.app.kv_cache import cache_argument
from tightfit.app.models import pooled_embeddings
from tightfit.distributed.plan import keeps_last_logits
from tightfit.kinds import CAUSAL_LM

__all__ = ["StageStep"]


class StageStep:
    """``model`` (a stage, loaded) run as stage ``index`` of ``count``, on ``device``, for
    the first stage's ``inputs`` (the prompt, or a batch of sentences with its mask)."""

    def __init__(
        self, model: Any, kind: str, index: int, count: int, device: torch.device, inputs: Mapping[str, torch.Tensor]
    ) -> None:
        self.model, self.kind, self.device = model, kind, device
        self.first, self.last = index == 0, index == count - 1
        self.ids = inputs["input_ids"].to(device)
        mask = inputs.get("attention_mask")
        self.mask = mask.to(device) if mask is not None else None
        self.keeps_last = self.last and keeps_last_logits(model)

    def into_batch(self, embeddings: torch.Tensor | None, out: torch.Tensor, rows: slice, parts: int) -> torch.Tensor:
        """The batch's embeddings with ``out``, those of its ``rows``, written in: a tensor
        made at the first of several micro-batches (the plan holds it for the last stage);
        with one micro-batch, ``out`` itself."""
        if parts == 1:
            return out
        if embeddings is None:
            embeddings = out.new_empty(self.ids.shape[0], out.shape[-1])
        embeddings[rows] = out
        return embeddings

    def new_cache(self) -> dict[str, Any]:
        """A fresh KV cache for a generation (none for an encoder), as the forward's keyword."""
        return cache_argument(self.model) if self.kind == CAUSAL_LM else {}

    @torch.inference_mode()
    def __call__(
        self, taken: torch.Tensor, cache: dict[str, Any], step: int = 0, rows: slice = slice(None)
    ) -> torch.Tensor:
        """The stage's output for ``taken`` (token ids on the first stage, hidden states
        after it) at generation ``step`` (0: the prefill; an encoder has only step 0), of
        the batch's ``rows`` (an encoder's micro-batch)."""
        keyword = "input_ids" if self.first else "inputs_embeds"
        if self.kind != CAUSAL_LM:
            mask = self.mask[rows] if self.mask is not None else None
            extra = {"attention_mask": mask} if mask is not None else {}
            hidden = self.model(**{keyword: taken}, **extra).last_hidden_state
            if not self.last:
                return hidden
            return pooled_embeddings(
                hidden, mask if mask is not None else torch.ones(taken.shape[:2], device=self.device)
            )
        extra: dict[str, Any] = {"use_cache": True}
        if step == 0 and self.keeps_last:
            extra["logits_to_keep"] = torch.tensor([self.ids.shape[1] - 1], device=self.device)
        out = self.model(**{keyword: taken}, **extra, **cache)
        return next_token(out) if self.last else out.logits  # a stage before the last gives its hidden states
