"""What the parts of a batched minicpmo step share (step.py drives them; decode.py and
tts.py work on its rows): one session's unit in the step, and the decoder's unit-end
bookkeeping. Apart from step.py so that the parts do not import one another in a circle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from omnifabric.worker.engine import StepRow

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine, MiniCPMOSession
    from omnifabric.worker.engines.minicpmo.slots import FeedResult, SlotCache


class Steps(Protocol):
    """What the decode loop uses of the stepper (step.MiniCPMOStepper)."""

    @property
    def engine(self) -> MiniCPMOEngine: ...
    @property
    def cache(self) -> SlotCache: ...
    def defer(self, row: Row, ids: list[int]) -> None: ...
    def decode_feed(self, rows: list[tuple[int, torch.Tensor]]) -> FeedResult: ...


@dataclass
class Row:
    """One session's unit in the step, from its preparation to its result."""

    index: int
    session: MiniCPMOSession
    step_row: StepRow
    duplex: Any
    args: dict[str, Any]
    force: bool
    close_turn: bool
    deferred: list[int]
    """KV tokens of the previous unit not fed yet ([terminator, </unit>])."""
    results: list[int] = field(default_factory=list)
    """Tokens of function outputs fed after `deferred`, before `<unit>` (calls.CallWatch)."""
    speech: bool | None = None
    """The duplex's generate_audio to put back after a unit run without speech (a unit
    inside a function call); None: untouched."""
    images: list[Any] = field(default_factory=list)
    frames: Any = None
    slice_counts: list[int] = field(default_factory=list)
    vision: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    prefill_ids: list[Any] = field(default_factory=list)
    n_pending: int = 0
    """Position (1-based) of the row's pending logits among its prefill tokens."""
    costs: dict[str, float] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    ids: list[int] = field(default_factory=list)
    hidden: list[list[Any]] = field(default_factory=list)
    terminator: int | None = None
    is_listen: bool = False
    end_of_turn: bool = False
    had_tts_pad: bool = False
    text: str = ""
    tts_start_zero: bool = False
    tts_tokens: torch.Tensor | None = None
    tts_codes: list[int] | None = None
    """tts_tokens on the host (one read for all the step's speakers)."""
    wave: np.ndarray | None = None


def unit_end(dec: Any, pending: dict[str, Any], cache_len: int) -> None:
    """The decoder's unit-end bookkeeping (its window history), at context length
    `cache_len` (what the decoder would read from its own cache)."""
    if dec._pending_unit_id is None:
        return
    length = cache_len - dec._pending_unit_start_cache_len
    if length > 0:
        dec._unit_history.append(
            {
                "unit_id": dec._pending_unit_id,
                "length": length,
                "type": pending["input_type"],
                "generated_tokens": pending["total_ids_in_unit"] or [],
                "generated_text": pending["generated_text"] or "",
                "is_listen": pending["is_listen"],
            }
        )
    dec._pending_unit_id = None
    dec._pending_unit_start_cache_len = 0
    dec._next_unit_id += 1
