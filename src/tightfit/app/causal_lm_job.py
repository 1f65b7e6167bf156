"""``tightfit run`` on a causal LM: generate greedily from a prompt, with the KV cache and
the context planned within a budget (:mod:`tightfit.app.kv_cache`), decoding replayed from
a captured CUDA graph where the run allows it; quality is the token agreement with full
precision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tightfit._format import human_bytes
from tightfit.app import captured, kv_cache
from tightfit.app.budget import KV_CACHE, KV_DECODED, Budgeted
from tightfit.app.generation import Generation, generate_greedy, prefill_inputs
from tightfit.app.generation_job import GenerationJob
from tightfit.app.spelling import assigned, option
from tightfit.fitting import FitError, FitPlan
from tightfit.kinds import CAUSAL_LM

if TYPE_CHECKING:
    from tightfit import backends
    from tightfit.app.run import RunOptions

__all__ = ["CausalLMJob"]


class CausalLMJob(GenerationJob):
    """Generates ``max_new_tokens`` greedily from the prompt, its KV cache and context planned."""

    kind = CAUSAL_LM

    def __init__(
        self, folder: Path, device: torch.device, options: RunOptions, backend: backends.Backend, skeleton: Any = None
    ) -> None:
        super().__init__(folder, device, options, backend, skeleton)
        self.limit = getattr(self.model.config, "max_position_embeddings", None)
        length = self.input_ids.shape[1] + self.max_new_tokens
        if self.limit is not None and length > self.limit:
            raise ValueError(
                f"{option('prompt')} ({self.input_ids.shape[1]} tokens) and {assigned('max_new_tokens', self.max_new_tokens)} "
                f"make {length} positions; the model takes at most {self.limit} (max_position_embeddings in its config.json)"
            )
        #: Positions the run's KV cache reaches: the prompt, and every new token but the last fed back.
        self.run_positions = length - 1
        self.context = options.context if isinstance(options.context, int) else None
        if self.context is not None and not self.run_positions <= self.context <= (self.limit or self.context):
            raise ValueError(
                f"{assigned('context', self.context)} is outside what this run can use: at least the "
                f"{self.run_positions} positions it reaches (the {self.input_ids.shape[1]}-token prompt and "
                f"{self.max_new_tokens - 1} new tokens fed back), at most the model's "
                f"{self.limit} (max_position_embeddings)"
            )
        self.context_note = ""
        self.context_limited = False  # --context auto: the budget, not the model, set the context
        self.kv_format = "model" if options.kv_cache == "auto" else options.kv_cache
        self.kv_note = ""
        if self.kv_format != "model":
            kv_cache.cache_argument(self.model, self.kv_format)  # refused here where the model's cache cannot
        self.graph_choice = options.graph
        self.graph: bool | None = None  # decided at the first call, with the weights where they run

    def call(self) -> Generation:
        if self.graph is None:
            self.graph = self._decode_graph()
        return generate_greedy(
            self.model,
            self.input_ids,
            self.max_new_tokens,
            self.synchronize,
            graph=self.graph,
            kv_format=self.kv_format,
        )

    def _decode_graph(self) -> bool:
        """Whether decoding replays a captured CUDA graph: ``--graph`` where this run allows
        it; ``on`` where it does not is refused with the reason."""
        if self.graph_choice == "off" or self.max_new_tokens == 1:
            return False
        try:
            captured.check_capturable(self.model, self.input_ids)
            if self.kv_format != "model":
                raise ValueError(f"the KV cache is {self.kv_format}; a captured decode keeps it in the model's dtype")
            scratch = (self.input_ids.shape[1] + self.max_new_tokens) * self._per_token()
            if self.headroom is not None and scratch > self.headroom:
                raise ValueError(
                    f"capturing warms up on a second static KV cache ({human_bytes(scratch)}), and the budget "
                    f"leaves {human_bytes(max(self.headroom, 0))} above the plan's predicted peak"
                )
        except ValueError as error:
            if self.graph_choice == "on":
                raise ValueError(f"{assigned('graph', 'on')}: {error}") from None
            return False
        return True

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The prefill over the prompt: what a plan is made for (its KV cache included)."""
        return prefill_inputs(self.model, self.input_ids)

    def kv_cache_bytes(self) -> int:
        """The KV cache's growth beyond the prompt (whose share the prefill holds) to the
        context planned for: by default the one-token forwards after the prefill."""
        return (self.planned_context() - self.input_ids.shape[1]) * self._per_token()

    def kv_decoded_bytes(self) -> int:
        """A float8 cache's layer decoded while it attends, at the context planned for."""
        return kv_cache.decoded_bytes(self.model.config, self.dtype, self.kv_format, self.planned_context())

    def _per_token(self) -> int:
        return kv_cache.bytes_per_token(self.model.config, self.dtype, self.kv_format)

    def choose_kv_format(self, planned: Callable[[], Budgeted], kv_format: str, budget: int) -> Budgeted:
        """``planned()`` with the cache in ``kv_format``; ``"auto"``: the model's dtype,
        unless the budget holds the run only with a float8 cache, or (``--context auto``)
        a longer context with one; the choice is said in ``covers``."""
        if kv_format != "auto":
            return planned()
        failed: FitError | None = None
        try:
            kept = planned()
        except FitError as error:
            kept, failed = None, error
        if kept is not None and not self.context_limited:
            return kept
        chosen = self.context, self.context_note, self.context_limited  # what kept was planned with
        if failed is not None and failed.smallest_peak_bytes - self.kv_cache_bytes() > budget:
            raise failed from None  # no cache at all would fit: a smaller one cannot help
        try:
            kv_cache.cache_argument(self.model, "float8")
        except ValueError:  # the model's cache cannot be float8: the model's format's plan, or its error
            if kept is None:
                raise failed from None
            return kept
        self.kv_format = "float8"
        try:
            smaller = planned()
        except FitError:
            smaller = None
        if smaller is None or (kept is not None and smaller.context <= kept.context):
            self.kv_format = "model"
            if kept is None:
                raise failed from None  # the model's format's error: what the caller knows the run by
            self.context, self.context_note, self.context_limited = chosen  # the float8 attempt moved them
            return kept
        model_context = None if kept is None else kept.context
        self.kv_note = f"; float8 KV cache: in {str(self.dtype).removeprefix('torch.')} the budget holds " + (
            "no plan of this run" if model_context is None else f"a context of {model_context:,} positions only"
        )
        return replace(smaller, covers=self.covers())

    def planned_context(self) -> int:
        """The positions the KV cache is planned for: ``--context``, or what the run reaches."""
        return self.run_positions if self.context is None else self.context

    def covers(self) -> str:
        decoded = self.kv_decoded_bytes()
        held = f", and one layer of it decoded while it attends ({human_bytes(decoded)})" if decoded else ""
        cache = kv_cache.describe(self.kv_format, self.model.config, self.dtype)
        if self.context is None:
            return (
                f"the prefill forward over the {self.input_ids.shape[1]}-token prompt, plus the KV cache's growth over "
                f"the {self.max_new_tokens - 1} one-token decode forwards ({human_bytes(self.kv_cache_bytes())}){held}; "
                f"{cache}{self.kv_note}"
            )
        return (
            f"the prefill forward over the {self.input_ids.shape[1]}-token prompt, plus the KV cache's growth to a "
            f"context of {self.context:,} positions ({human_bytes(self.kv_cache_bytes())}{self.context_note}){held}; "
            f"{cache}{self.kv_note}"
        )

    def carried_out(self, plan: FitPlan) -> Budgeted:
        """``plan`` as made before (``--plan``), its context what it reserved for the KV
        cache; refused where this run's cache would outgrow it."""
        self.kv_format = "float8" if KV_DECODED in plan.reserved else "model"
        per_token = self._per_token()
        self.context = self.input_ids.shape[1] + plan.reserved.get(KV_CACHE, 0) // per_token
        if self.context < self.run_positions:
            raise ValueError(
                f"the plan reserves the KV cache for {self.context} positions with this prompt "
                f"({human_bytes(plan.reserved.get(KV_CACHE, 0))}); this run reaches {self.run_positions} (the "
                f"{self.input_ids.shape[1]}-token prompt and {self.max_new_tokens - 1} new tokens fed back): give a "
                f"smaller {option('max_new_tokens')}, or plan again with {option('context')}"
            )
        return Budgeted(plan, self.covers(), self.context, self.kv_format)

    def longest_context(self, plan: Callable[[], Budgeted], budget: int) -> Budgeted:
        """``plan()`` at the longest context the budget allows (``--context auto``): at least
        the run's own positions, at most the model's ``max_position_embeddings``. The KV
        cache's bytes grow linearly with the context, and the rest of the plan needs at
        least its smallest reachable peak, so one plan at the model's maximum (or the most
        the budget holds of the cache alone, where that is less) either fits or, failing,
        tells that peak; the context is then what the budget leaves. A float8 cache's decoded
        layer grows with the context too, and counts per position beside the growth."""
        per_token = self._per_token()
        decoded = kv_cache.decoded_bytes(self.model.config, self.dtype, self.kv_format, 1)  # per position
        prompt = self.input_ids.shape[1]
        held = (max(budget - 1, 0) + per_token * prompt) // (per_token + decoded)  # the cache alone, below the budget
        most = min(self.limit, held) if self.limit is not None else held
        self.context = max(most, self.run_positions)
        self.context_limited = self.limit is None or held < self.limit
        try:
            budgeted = plan()
            self.context_note = (
                ", the longest the budget leaves room for"
                if self.context_limited
                else ", the model's max_position_embeddings: the most it takes"
            )
        except FitError as error:
            self.context_limited = True
            without_cache = error.smallest_peak_bytes - self.kv_cache_bytes() - self.kv_decoded_bytes()
            room = max(budget - without_cache + per_token * prompt, 0)  # growth (context - prompt) + decoded (context)
            self.context = min(max(room // (per_token + decoded), prompt), most)
            if self.context < self.run_positions:
                self.context = self.run_positions  # the run's own positions: plan() says what is missing
            self.context_note = ", the longest the budget leaves room for beside the smallest plan of the weights"
            budgeted = plan()
        return replace(budgeted, covers=self.covers())
