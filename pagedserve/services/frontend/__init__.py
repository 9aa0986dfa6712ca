"""The frontend: public API, tokenization, and the continuous-batching scheduler and engine."""
