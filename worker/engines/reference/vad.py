"""Voice activity with silero-vad (TorchScript model shipped in the `silero-vad` package).

The TorchScript model keeps recurrent state between windows, so every session gets its
own instance (loading one costs ~35 ms and ~2 MB).
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import torch

#: silero-vad at 16 kHz takes windows of exactly 512 samples (32 ms).
WINDOW = 512
WINDOW_S = WINDOW / 16000


def model_path() -> Path:
    """The package's silero_vad.jit, located without importing the package (its import
    changes torch's thread count)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed: pip install silero-vad==6.2.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.jit"
    if not path.exists():
        raise RuntimeError(f"silero-vad model file missing: {path}")
    return path


class VoiceActivity:
    """Per-session speech detector: speech probability for each 32 ms window."""

    def __init__(self, path: Path | None = None, threshold: float = 0.5) -> None:
        self.threshold = threshold
        with warnings.catch_warnings():
            # The package ships TorchScript; torch 2.13 warns that jit.load is deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            # Always CPU, also when the engine runs on CUDA: 32 ms windows one at a time would
            # spend more on transfers than on the ~2 MB model.
            self._model = torch.jit.load(str(path or model_path()), map_location="cpu")
        self._model.eval()
        self._carry = np.zeros(0, np.float32)

    def windows(self, pcm: np.ndarray) -> np.ndarray:
        """Speech flags (bool) for each whole 512-sample window of `pcm`; a remainder is
        carried into the next call so windows stay aligned across units."""
        audio = np.concatenate([self._carry, pcm.astype(np.float32, copy=False)])
        n = audio.size // WINDOW
        self._carry = audio[n * WINDOW :].copy()
        flags = np.zeros(n, dtype=bool)
        with torch.inference_mode():
            for i in range(n):
                chunk = torch.from_numpy(audio[i * WINDOW : (i + 1) * WINDOW].copy())
                flags[i] = float(self._model(chunk, 16000)) >= self.threshold
        return flags

    def reset(self) -> None:
        """Forget the recurrent state (a new utterance context)."""
        self._model.reset_states()
        self._carry = np.zeros(0, np.float32)
