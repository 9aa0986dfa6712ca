"""pagedserve: LLM serving on PagedAttention, operated by Kubernetes."""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .services.frontend.llm import LLM
    from .services.frontend.request import GenerationParams

__all__ = ["LLM", "GenerationParams", "__version__"]


def __getattr__(name: str) -> Any:
    """`pagedserve.LLM` and `pagedserve.GenerationParams`, imported on first use (they pull in torch)."""
    if name == "LLM":
        from .services.frontend.llm import LLM

        return LLM
    if name == "GenerationParams":
        from .services.frontend.request import GenerationParams

        return GenerationParams
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
