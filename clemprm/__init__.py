"""clemprm: teach language models to play clembench dialogue games with SFT and a process reward model."""

__version__ = "0.1.0"
