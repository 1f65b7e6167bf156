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
from tightfit.app.budget import Budgeted
from tightfit.app.generation import Generation, generate_greedy, next_token, prefill_inputs
from tightfit.app.generation_job import GenerationJob
from tightfit.app.spelling import assigned, option
from tightfit.fitting import FitError, FitPlan
from tightfit.fitting.traced import DECODE, DecodeTrace
from tightfit.kinds import CAUSAL_LM

if TYPE_CHECKING:
    from tightfit import backends
    from tightfit.app.run import RunOptions
    from tightfit.memory.simulate import Calls

__all__ = ["CONTEXT_PLANS", "CausalLMJob"]

#: The most plans ``--context auto`` makes while closing in on the longest context that fits.
CONTEXT_PLANS = 8


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
        """The KV cache's bytes at the context planned for."""
        return self.planned_context() * self._per_token()

    def decode_trace(self) -> DecodeTrace | None:
        """The last decode step at the context planned for: a forward over ``context - 1``
        positions fills the cache (as the prefill and the decode steps before it did), then
        the next token's forward, holding what :func:`generate_greedy` holds between them."""
        if not self.decode_steps():
            return None
        model, kv_format, context = self.model, self.kv_format, self.planned_context()

        def script(calls: Calls) -> None:
            cache = kv_cache.cache_argument(model, kv_format)
            history = torch.zeros(1, context - 1, dtype=torch.long, device=calls.device)
            token = next_token(calls.call(**prefill_inputs(model, history), use_cache=True, **cache))
            del history
            calls.phase(DECODE)
            calls.call(input_ids=token, use_cache=True, **cache)

        return DecodeTrace(script, context, kv_format, self.kv_cache_bytes())

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
        cache = kv_cache.describe(self.kv_format, self.model.config, self.dtype)
        at = f"{self.planned_context():,} positions ({human_bytes(self.kv_cache_bytes())}{self.context_note})"
        if self.context is not None:
            at = f"a context of {at}"
        return (
            f"the prefill forward over the {self.input_ids.shape[1]}-token prompt, and the last of the "
            f"{self.max_new_tokens - 1} one-token decode forwards, its KV cache at {at}; {cache}{self.kv_note}"
        )

    def carried_out(self, plan: FitPlan) -> Budgeted:
        """``plan`` as made before (``--plan``), its context and KV format what its last
        decode step was traced with; refused where this run's cache would outgrow it."""
        if not plan.kv_cache:
            raise ValueError(
                "the plan traced no decode step (it was not made for a generation, or by a tightfit before KV "
                f"caches were planned); plan this run again with tightfit fit {option('json')}"
            )
        self.kv_format = plan.kv_cache["format"]
        self.context = plan.kv_cache["context"]
        if self.context < self.run_positions:
            raise ValueError(
                f"the plan's KV cache holds {self.context} positions; this run reaches {self.run_positions} (the "
                f"{self.input_ids.shape[1]}-token prompt and {self.max_new_tokens - 1} new tokens fed back): give a "
                f"smaller {option('max_new_tokens')}, or plan again with {option('context')}"
            )
        return Budgeted(plan, self.covers(), self.context, self.kv_format)

    def longest_context(self, plan: Callable[[], Budgeted], budget: int) -> Budgeted:
        """``plan()`` at the longest context the budget allows (``--context auto``): at least
        the run's own positions, at most the model's ``max_position_embeddings``.

        The last decode step's peak grows with the context by about the cache's bytes a
        position (a float8 cache's decoded layer too): the first plan is at the most the
        budget holds of the cache alone; one over the budget steps down by its smallest
        peak's excess over the bytes a position, one within steps up by the room it leaves;
        the longest context that fits and the shortest that does not close in on each
        other, in at most :data:`CONTEXT_PLANS` plans (the longest that fitted is kept)."""
        slope = self._per_token() + kv_cache.decoded_bytes(self.model.config, self.dtype, self.kv_format, 1)
        held = max(budget - 1, 0) // slope  # the cache alone below the budget
        most = max(min(self.limit, held) if self.limit is not None else held, self.run_positions)
        fitted: tuple[int, Budgeted] | None = None
        over = most + 1  # the shortest context known not to fit
        self.context = most
        for _ in range(CONTEXT_PLANS):
            try:
                budgeted = plan()
            except FitError as error:
                if self.context == self.run_positions:
                    raise  # the run's own positions do not fit: the error says what is missing
                over = self.context
                guess = self.context - max(-(-(error.smallest_peak_bytes - budget) // slope), 1)
            else:
                fitted = self.context, budgeted
                guess = self.context + max((budget - budgeted.predicted_peak_bytes) // slope, 1)
            shortest = fitted[0] + 1 if fitted is not None else self.run_positions
            if shortest >= over:
                break
            self.context = min(max(guess, shortest), over - 1)
        if fitted is None:
            self.context = self.run_positions
            fitted = self.context, plan()  # fits, or says what is missing
        self.context, budgeted = fitted
        self.context_limited = self.context != self.limit
        self.context_note = (
            ", the longest the budget leaves room for"
            if self.context_limited
            else ", the model's max_position_embeddings: the most it takes"
        )
        return replace(budgeted, covers=self.covers())
