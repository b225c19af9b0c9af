"""blockspec: fast batch-one decoding, greedy or sampled, of Qwen3.5-family hybrid models (plain, native MTP,
DFlash2)."""

from .config import PredictConfig
from .errors import BlockspecError, UnsupportedRequest

__all__ = ["Engine", "PredictConfig", "BlockspecError", "UnsupportedRequest"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "Engine":  # lazy: importing the package must stay cheap for the CLI's error paths
        from .engine.engine import Engine
        return Engine
    raise AttributeError(name)
