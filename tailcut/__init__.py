"""tailcut: an SLO-aware request pipeline in front of LLM inference engines."""

__version__ = "0.1.0"
