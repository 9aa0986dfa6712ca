"""pagedserve: LLM serving on PagedAttention, operated by Kubernetes."""

__version__ = "0.1.0"
