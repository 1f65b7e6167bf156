"""tightfit: run one PyTorch model on any accelerator, and make it fit in its memory.

Importing tightfit does no device work: backends are detected at first use (D2). The
layers, and the decisions the code cites as (D1) to (D9), are in docs/architecture.md.
"""

from tightfit import backends, graph, hints, ops
from tightfit._deprecation import renamed
from tightfit._errors import BackendConflictError, FallbackWarning, StrictModeError
from tightfit._strict import is_strict, strict
from tightfit.fitting import FitError, FitPlan, fit, parse_size
from tightfit.graph._register import register as _register_compile_backend
from tightfit.hints import hint, hints_of
from tightfit.loading import load, save
from tightfit.memory import MemoryPlan, plan_memory

__version__ = "0.1.0"

_register_compile_backend()  # torch.compile(model, backend="tightfit"), also from a source checkout

__all__ = [
    "BackendConflictError",
    "FallbackWarning",
    "FitError",
    "FitPlan",
    "MemoryPlan",
    "StrictModeError",
    "__version__",
    "backends",
    "fit",
    "graph",
    "hint",
    "hints",
    "hints_of",
    "is_strict",
    "load",
    "ops",
    "parse_size",
    "plan_memory",
    "save",
    "strict",
]


__getattr__ = renamed(__name__, Plan=("FitPlan", lambda: FitPlan))
