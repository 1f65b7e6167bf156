"""tightfit: run one PyTorch model on any accelerator, and make it fit in its memory.

Importing tightfit does no device work: backends are detected at first use.
"""

from tightfit import backends, ops
from tightfit._errors import BackendConflictError, FallbackWarning, StrictModeError
from tightfit._strict import is_strict, strict

__version__ = "0.1.0"

__all__ = [
    "BackendConflictError",
    "FallbackWarning",
    "StrictModeError",
    "__version__",
    "backends",
    "is_strict",
    "ops",
    "strict",
]
