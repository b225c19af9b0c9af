"""DFlash2 drafter: block proposals from committed target features (see docs in model.py)."""

from blockspec.drafter.config import DrafterConfig
from blockspec.drafter.model import DFlash2Drafter

__all__ = ["DFlash2Drafter", "DrafterConfig"]
