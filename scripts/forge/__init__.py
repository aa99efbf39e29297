"""dcu-forge: build, serve, benchmark and score a patched vLLM 0.18.1 for Qwen3.5-27B on Hygon DCU."""

__version__ = "0.1.0"
