"""tierkv: a cold KV-cache tier for LLM inference engines on ordinary LAN machines."""

__version__ = "0.2.0"
