"""A progress bar over a checkpoint's shards while they load: bytes read and GB/s, on stderr (stdout may carry
--json). Drawn by tqdm when it is installed (an optional dependency: without it nothing is shown), and only for
checkpoints large enough to take more than a moment to read."""

from __future__ import annotations

import sys
from pathlib import Path

SHOWN_FROM_BYTES = 2 * 10 ** 9


class ShardProgress:
    def __init__(self, files: list[Path], enabled: bool, what: str = "loading weights"):
        total = sum(f.stat().st_size for f in files)
        self.bar, self.read = None, 0
        if not enabled or total < SHOWN_FROM_BYTES:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True)

    def tensor_read(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)
            self.read += nbytes

    def shard_read(self, path: Path) -> None:
        """The rest of the shard's size (its header) once all of its tensors are read."""
        if self.bar is not None:
            self.bar.update(max(0, path.stat().st_size - self.read))
            self.read = 0

    def __enter__(self) -> "ShardProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:  # closed before any error line is printed
            self.bar.close()
