"""The MiniCPM-o 4.5 engine: the production model, driven through its own public code.

Nothing of the model is copied here. The checkpoint directory carries the model's code;
`layouts` finds which of its three public layouts the directory offers and wraps one duplex
state per slot; `state` moves the per-stream state the code keeps on the shared model in
and out around each call, so several sessions share one copy of the weights.
Calls run on the worker's single engine thread; the engine lock also keeps one session's
prepare or close out of another's unit.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from omnifabric.worker.config import switch
from omnifabric.worker.engine import (
    ChatChunk,
    ChatMessage,
    ChatTurn,
    DuplexSettings,
    Engine,
    EngineSession,
    GenerateResult,
    KvFigures,
    StepOutcome,
    Stepper,
    StepRow,
    ToolChoice,
    ToolSpec,
)
from omnifabric.worker.engines.minicpmo import layouts, vocoder, voice
from omnifabric.worker.engines.minicpmo.calls import (
    NO_TEMPLATE,
    CallWatch,
    calls_from,
    tool_turn,
    tools_text,
)
from omnifabric.worker.engines.minicpmo.code import import_module
from omnifabric.worker.engines.minicpmo.state import SharedState
from omnifabric.worker.errors import EngineUnavailable

if TYPE_CHECKING:  # it imports torch (silero-vad)
    from omnifabric.worker.engines.minicpmo.half_duplex import HalfDuplexCall

log = logging.getLogger("omnifabric.worker.minicpmo")

#: The model's code needs transformers 4.51.x (it fails on 5.x).
TRANSFORMERS_SERIES = "4.51."
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
#: Per unit the model speaks at most this many tokens (MODELS.md: 20 tokens, 28 chars).
MAX_SPEAK_TOKENS = 20
#: Startup protection: the model's first units listen.
FORCE_LISTEN_COUNT = 3
#: Sampling defaults of the reference server (every argument explicit).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "decode_mode": "sampling",
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "listen_prob_scale": 1.0,
    "listen_top_k": None,
    "text_repetition_penalty": 1.05,
    "text_repetition_window_size": 512,
    "length_penalty": 1.1,
}
#: The note of a session whose context window the layout's code cannot slide.
WINDOW_UNAVAILABLE = (
    "context_window: not available in this model code layout; the session closes with context_full"
)
#: A half-duplex call runs the model's chat path, which has no sliding window.
WINDOW_NOT_IN_CALLS = (
    "context_window: half-duplex calls run without one (the model's chat path has none)"
)
#: The speech token the model code pads a turn's first vocoder chunk with (silence), and the
#: tokens a vocoder chunk takes: 25 fresh, 3 of lookahead.
SILENCE_TOKEN, CHUNK_TOKENS, LOOKAHEAD_TOKENS = 4218, 25, 3
#: The vocoder package (minicpmo-utils) the model's init_tts imports.
VOCODER_MODULE = "stepaudio2"
#: Python packages the model code imports at load.
CODE_REQUIREMENTS = ("librosa", "soundfile", "tqdm", "PIL", "transformers")


def check_model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory, checked for what loading needs. Raises EngineUnavailable
    naming the first thing missing."""
    if not path:
        raise EngineUnavailable("engine 'minicpmo' needs --model-dir DIR (the checkpoint)")
    root = Path(path)
    if not root.is_dir():
        raise EngineUnavailable(f"model directory {root} is not a directory")
    if not (root / "config.json").is_file():
        raise EngineUnavailable(f"{root} has no config.json: not a Hugging Face checkpoint")
    if not any(root.glob("*.safetensors")) and not (root / "model.safetensors.index.json").exists():
        raise EngineUnavailable(f"{root} has no *.safetensors weights")
    if not (root / "modeling_minicpmo.py").is_file():
        raise EngineUnavailable(f"{root} has no modeling_minicpmo.py: the model's own code")
    return root


def check_runtime(device: str, transformers_version: str | None = None) -> None:
    """transformers 4.51.x, the model code's imports, and a usable device. Raises
    EngineUnavailable."""
    version = transformers_version or importlib.metadata.version("transformers")
    if not version.startswith(TRANSFORMERS_SERIES):
        raise EngineUnavailable(
            f"MiniCPM-o 4.5 needs transformers {TRANSFORMERS_SERIES}x, found {version}"
        )
    if device != "cpu" and not device.startswith("cuda"):
        raise EngineUnavailable(f"engine 'minicpmo' runs on cuda or cpu, not on {device!r}")
    missing = [m for m in CODE_REQUIREMENTS if importlib.util.find_spec(m) is None]
    if missing:
        raise EngineUnavailable(
            f"the MiniCPM-o code needs {', '.join(missing)}: pip install '.[minicpmo]'"
        )
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable("engine 'minicpmo' needs CUDA: torch.cuda.is_available() is False")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise EngineUnavailable(
            f"device {device} does not exist ({torch.cuda.device_count()} CUDA devices)"
        )


def avoid_cudnn_attention(torch: Any) -> None:
    """Takes cuDNN out of torch's scaled_dot_product_attention for this process (flash,
    memory-efficient and math remain). cuDNN builds a graph per shape, and a duplex step's
    shapes change every call (each decode step's key length grows, ragged rows differ): on an
    H100 (torch 2.11, cu130) a profile of a batched step of the full-size model spent
    4.5 ms of host time in each attention call with the GPU mostly idle."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("minicpmo: cuDNN attention off (a graph per shape; duplex shapes change per call)")


def vocoder_problem(root: Path, device: str) -> str | None:
    """Why speech output cannot run here, or None when it can (on any device: the engine
    builds the vocoder through worker/engines/minicpmo/vocoder.py)."""
    if importlib.util.find_spec(VOCODER_MODULE) is None:
        return f"the vocoder package is not installed ({VOCODER_MODULE}: minicpmo-utils)"
    return vocoder.problem(root / "assets" / "token2wav")


def _ms(costs: dict[str, Any], rename_all: str | None = None) -> dict[str, float]:
    """cost_* seconds as milliseconds keyed without the prefix (cost_all -> rename_all)."""
    out = {}
    for key, value in costs.items():
        if key.startswith("cost_") and isinstance(value, int | float):
            name = key[5:]
            if name == "all" and rename_all:
                name = rename_all
            out[name] = float(value) * 1000.0
    return out


def _images(frames: list[bytes]) -> list[Any]:
    from PIL import Image

    return [Image.open(io.BytesIO(f)).convert("RGB") for f in frames]


class BatchedStep(Protocol):
    """What the engine and its sessions use of the batched step (step.MiniCPMOStepper,
    which drives this module's sessions; the worker's engine registry hands its class in)."""

    def step(self, rows: Sequence[StepRow]) -> StepOutcome: ...
    def release(self, session: MiniCPMOSession) -> None: ...
    def unslot(self, session: MiniCPMOSession) -> None: ...
    def kv_length(self, session: MiniCPMOSession) -> int: ...
    def tts_cache(self) -> Any: ...
    def capture_graphs(self) -> dict[str, int]: ...
    @property
    def cache(self) -> Any: ...


def _more_slots(device: Any, per_slot: int) -> int:
    """On CUDA, how many more slots the device's free memory would hold now; 0 elsewhere."""
    if device.type != "cuda" or per_slot <= 0:
        return 0
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free // per_slot)


def _at_least(name: str, value: int | None, low: int) -> int | None:
    """An engine parameter that may be left unset (None), or ValueError naming it."""
    if value is not None and value < low:
        raise ValueError(f"{name} is {low} or more, not {value}")
    return value


def slot_tokens(config: Any) -> int:
    """The context a batched slot is sized for: a basic window's high watermark when the
    worker's sessions slide by one (they never hold more; the slot follows the window),
    else the context cap."""
    window = config.window()
    return window.high_tokens if window.mode == "basic" else int(config.max_context_tokens)


class MiniCPMOSession(EngineSession):
    """One duplex session on one slot's duplex handle."""

    def __init__(self, engine: MiniCPMOEngine, handle: layouts.Handle, session_id: str, mode: str):
        self.engine = engine
        self.handle = handle
        self.session_id = session_id
        self.mode = mode
        self.settings = DuplexSettings()
        self.shared = engine.state.fresh()
        """This session's values of the state kept on the shared model."""
        self.units = 0
        self.output_tokens = 0
        self.voice_path: str | None = None
        self._own_voice = False
        self.vision_tokens = 0
        self.input_tokens = 0
        self.closed = False
        self.call: HalfDuplexCall | None = None
        """Set by prepare for a half-duplex call (the model's chat path, not its duplex)."""
        self.kv_slot: int | None = None
        """The batched stepper's slot that holds this session's LLM KV cache (the decoder's
        own cache is then None), or None while the decoder holds it (step.py)."""
        self.tts_slot: int | None = None
        """Batched: the TTS slot cache's row that holds this session's TTS past from its
        first speaking step on (tts.py; the duplex object's `tts_past_key_values` is then
        None), freed with its LLM slot."""
        self.finalize_due = False
        """Batched: the stepper took this unit's deferred finalize; its tokens go into the
        next step's prefill (counted by kv_length meanwhile)."""
        self.generator: Any = None
        """Batched: this session's own sampling generator, where settings.seed is set."""
        self.mel_cache: Any = None
        """Batched: the raw log-mel frames of its audio window that later audio cannot
        change (mel.MelCache), for its next unit."""
        self.watch: CallWatch | None = None
        """Its function calls, when functions were offered (offer_tools)."""
        self._prompt: tuple[str, np.ndarray | None] = ("", None)
        """The system prompt and LLM reference audio prepare put in (offer_tools puts them
        in again with the functions)."""

    def unit_samples(self) -> tuple[int, int]:
        return self.engine.first_unit_samples, self.engine.unit_samples

    def prepare(
        self,
        system_prompt: str,
        ref_audio: np.ndarray | None,
        tts_ref_audio: np.ndarray | None,
        config: DuplexSettings,
    ) -> int:
        self.settings = config
        engine = self.engine
        if self.kv_slot is not None and engine.batched is not None:
            engine.batched.release(self)  # a new context: the old slot goes
        self.generator = None
        prompt = system_prompt.strip() or DEFAULT_SYSTEM_PROMPT
        ref = ref_audio if ref_audio is not None and ref_audio.size else None
        voice_pcm = tts_ref_audio if tts_ref_audio is not None and tts_ref_audio.size else ref
        if config.seed is not None:
            import torch

            # The session's own RNG (state.py swaps it per session): its draws (the TTS's
            # too, which also time a call's text pieces) follow from the seed alone; the
            # batched path seeds its generator the same.
            with engine.using(self):
                torch.manual_seed(config.seed)
        self._unwatch()
        if config.half_duplex:
            return self._prepare_call(prompt, ref, voice_pcm)
        self.notes = config.vad_note()
        self._prompt = (prompt, ref)
        with engine.using(self):
            speech = engine.audio_on and config.tts_enabled is not False
            if speech and voice_pcm is not None:
                self.voice_path, self._own_voice = voice.write_wav(voice_pcm), True
            elif speech:
                self.voice_path = str(engine.default_voice)
            if not self._put_prompt(prompt, ref):
                self.notes = (*self.notes, WINDOW_UNAVAILABLE)
            return self.handle.kv_length()

    def _put_prompt(self, prompt: str, ref: np.ndarray | None) -> bool:
        """A fresh context of the system prompt, the reference audio and the voice (under
        the engine); False when the layout's code cannot slide the session's window."""
        self.handle.reset()
        # The model's own sliding window, set before the prompt goes in (its context mode
        # marks where the prompt's prefix ends while prepare feeds it).
        window = self.handle.set_window(self.settings.window())
        speech = self.engine.audio_on and self.settings.tts_enabled is not False
        self.handle.duplex.generate_audio = speech
        self.handle.prepare(prompt, ref, self.voice_path)
        vocoder.share_kept(self.engine.model, self.handle.duplex)
        return window

    # ---- functions ---------------------------------------------------------------------

    def offer_tools(self, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> tuple[str, ...]:
        """The functions in the duplex system prompt as the checkpoint's chat template
        writes them (its tools block after the client's prompt; the context is begun again
        with it, before the first unit), and the model's calls read from what it says
        (calls.CallWatch). With the choice none nothing is offered."""
        if not tools or not choice.allows_calls():
            return ()
        if self.call is not None:
            return ("tools: a half-duplex call does not call functions",)
        if self.units:
            return ("tools: offered after the session's first unit: not taken",)
        block = tools_text(self.engine.tokenizer, tools, choice)
        if not block:
            return (NO_TEMPLATE,)
        self._unslot()
        prompt, ref = self._prompt
        with self.engine.using(self):
            self._put_prompt(f"{prompt}\n\n{block}", ref)
            self.watch = CallWatch(tools, choice, self.engine.tokenizer)
            self.watch.session_id = self.session_id
            d = self.handle.duplex
            d._convert_results_to_tts_input = self.watch.tts_input(d._convert_results_to_tts_input)
        return ()

    def tool_output(self, call_id: str, output: str) -> None:
        """A call's output: with the others of its calls it goes into the context before
        the next unit (CallWatch.output)."""
        if self.watch is not None:
            self.watch.output(call_id, output)

    def _unwatch(self) -> None:
        """No more calls: the duplex's TTS condition as the model's code makes it."""
        if self.watch is not None:
            self.watch = None
            vars(self.handle.duplex).pop("_convert_results_to_tts_input", None)

    def feed_results(self) -> int:
        """Serial path, before the unit's prefill: the outputs of the session's calls fed
        (as the batched step feeds them: after the last unit's end, before ``<unit>``);
        how many tokens."""
        ids = self.watch.take_results() if self.watch is not None else []
        if ids:
            decoder = self.handle.duplex.decoder
            decoder.feed(decoder.embed_tokens(ids))
        return len(ids)

    def _prepare_call(
        self, prompt: str, ref_audio: np.ndarray | None, voice_pcm: np.ndarray | None
    ) -> int:
        """A half-duplex call: the model's streaming chat path under this session's id."""
        from omnifabric.worker.engines.minicpmo.half_duplex import HalfDuplexCall

        notes = []
        if self.settings.tts_enabled is not False and not self.engine.audio_on:
            notes.append("speech: this worker runs the model text-only (no vocoder)")
        if self.settings.window().mode != "off":
            notes.append(WINDOW_NOT_IN_CALLS)
        self.notes = tuple(notes)
        with self.engine.using(self):
            self.handle.reset()
            self.call = HalfDuplexCall(self.engine, f"call-{self.session_id}", self.settings)
            return self.call.prepare(prompt, ref_audio, voice_pcm)

    def prefill(
        self, pcm: np.ndarray, frames: list[bytes], max_slice_nums: int
    ) -> dict[str, float]:
        if self.call is not None:
            with self.engine.using(self):
                return self.call.hear(pcm.astype(np.float32, copy=False))
        self._unslot()
        with self.engine.using(self):
            images = _images(frames) if frames else []
            slices = max(1, max_slice_nums)
            self.vision_tokens = self.engine.vision_tokens(images, slices)
            fed = self.feed_results()
            before = self.handle.kv_length()
            out = self.handle.prefill(pcm.astype(np.float32, copy=False), images, slices)
            if isinstance(out, dict) and out.get("success") is False:
                raise RuntimeError(f"prefill failed: {out.get('reason') or 'no reason given'}")
            self.input_tokens = self.handle.kv_length() - before
            decoder = self.handle.duplex.decoder
            if fed and getattr(decoder, "_pending_unit_id", None) is not None:
                decoder._pending_unit_start_cache_len -= fed  # the outputs are the unit's
            return _ms(out, rename_all="prefill_all") if isinstance(out, dict) else {}

    def generate(self, force_listen: bool) -> GenerateResult:
        if self.call is not None:
            with self.engine.using(self):
                self.units += 1
                result = self.call.step(force_listen)
                self.output_tokens += result.n_tokens
                return result
        self._unslot()
        with self.engine.using(self):
            self.units += 1
            s = self.settings
            startup = (
                s.force_listen_count if s.force_listen_count is not None else FORCE_LISTEN_COUNT
            )
            capped = s.max_tokens is not None and 0 < s.max_tokens <= self.output_tokens
            called = self.watch is not None and self.watch.take_force()
            force = force_listen or self.units <= startup or capped or called
            if force and self.handle.speaking:
                self.handle.end_turn()  # the turn closes in the context; speech stops
            with self.quiet():
                out = self.handle.generate(self.sampling(), force)
            is_listen = bool(out.get("is_listen", True))
            audio = out.get("audio_waveform")
            if is_listen or audio is None or not self.handle.duplex.generate_audio:
                wave_out = np.zeros(0, np.float32)  # a listening unit carries 1 s of zeros
            else:
                wave_out = np.asarray(audio, dtype=np.float32).reshape(-1)
            n_tokens = int(out.get("n_tokens", 0) or 0)
            self.output_tokens += n_tokens
            result = GenerateResult(
                is_listen=is_listen,
                text="" if is_listen else str(out.get("text", "") or ""),
                audio=wave_out,
                end_of_turn=bool(out.get("end_of_turn", False)),
                kv_cache_length=self.handle.kv_length(),
                costs_ms=_ms(out, rename_all="generate_all"),
                n_tokens=n_tokens,
                n_tts_tokens=int(out.get("n_tts_tokens", 0) or 0),
                input_audio_tokens=max(0, self.input_tokens - self.vision_tokens),
                input_vision_tokens=self.vision_tokens,
            )
            return self.watched(result, force)

    def watched(self, result: GenerateResult, forced: bool) -> GenerateResult:
        """The unit's result with its calls taken out (CallWatch), as it is without them."""
        return self.watch.unit_result(result, forced) if self.watch is not None else result

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """A unit that begins inside a function call runs without speech (its text is the
        call's)."""
        d = self.handle.duplex
        if self.watch is None or not self.watch.silent:
            yield
            return
        speech, d.generate_audio = d.generate_audio, False
        try:
            yield
        finally:
            d.generate_audio = speech

    def sampling(self) -> dict[str, Any]:
        """Every streaming_generate argument, explicit: session settings over the defaults;
        temperature 0 means greedy decoding."""
        s = self.settings
        args = dict(SAMPLING_DEFAULTS)
        for key in ("temperature", "top_k", "top_p", "listen_prob_scale", "length_penalty"):
            value = getattr(s, key)
            if value is not None:
                args[key] = value
        if args["temperature"] == 0:
            args["decode_mode"], args["temperature"] = "greedy", SAMPLING_DEFAULTS["temperature"]
        args["max_new_speak_tokens_per_chunk"] = (
            s.max_new_speak_tokens_per_chunk or MAX_SPEAK_TOKENS
        )
        args["prompt_wav_path"] = self.voice_path
        return args

    def finalize(self) -> None:
        if self.call is not None:
            return  # the chat path closes a turn with the next prefill
        self._unslot()
        with self.engine.using(self):
            self.handle.finalize()

    def _unslot(self) -> None:
        """Before a call of the serial path: the LLM KV cache back from the batched
        stepper's slot into the decoder (and a finalize it took, run now)."""
        if self.kv_slot is not None and self.engine.batched is not None:
            self.engine.batched.unslot(self)

    def kv_length(self) -> int:
        """Tokens in this session's LLM context (a finalize taken by the batched stepper
        counts as done)."""
        if self.kv_slot is not None and self.engine.batched is not None:
            return self.engine.batched.kv_length(self)
        return self.handle.kv_length()

    @property
    def replying(self) -> bool:
        return self.call is None and self.handle.speaking

    def stop(self) -> None:
        """Nothing is generated outside a unit call: the next call simply never comes."""

    def close(self) -> None:
        """Free everything the session allocated (duplex state, KV cache, decoder and
        vocoder caches, the state on the shared model, its voice file); the worker then runs
        gc and torch.cuda.empty_cache() and checks memory."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.kv_slot is not None and self.engine.batched is not None:
                self.engine.batched.release(self)
            with self.engine.using(self):
                if self.call is not None:
                    self.call.close()
                self._unwatch()
                self.handle.reset()
                self.engine.state.clear()
                self.engine.forget(self)
        finally:
            self.shared = {}
            if self._own_voice and self.voice_path:
                Path(self.voice_path).unlink(missing_ok=True)
            self.engine.release(self)


class _ChatState:
    """A chat turn's values of the state kept on the shared model (see `using`)."""

    def __init__(self, shared: dict[str, Any]) -> None:
        self.shared = shared


class MiniCPMOEngine(Engine):
    """MiniCPM-o 4.5 from a local checkpoint directory: one copy of the weights, one duplex
    handle per slot."""

    name = "minicpmo"
    modes = frozenset({"audio", "video", "chat"})
    default_slots = 1
    concurrency = 1

    def __init__(
        self,
        model_path: str | None = None,
        device: str = "cuda",
        attn: str = "sdpa",
        compile: bool = False,
        slots: int = 1,
        api: str = "auto",
        text_only: bool = False,
        default_voice: str | None = None,
        vocoder_batched: bool = True,
        context_tokens: int = 8192,
        slot_tokens: int | None = None,
        stepper_class: Callable[[MiniCPMOEngine], BatchedStep] | None = None,
        dtype: str | None = None,
        cuda_graphs: str = "auto",
        decode_ahead: int | None = None,
        vocoder_tf32: str = "auto",
        tts_slot_tokens: int | None = None,
        slot_spare_tokens: int | None = None,
    ) -> None:
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        """torch dtype name of the weights; None: bfloat16 on CUDA, float32 elsewhere."""
        self.attn = attn
        self.compile = compile
        self.cuda_graphs = switch("cuda_graphs", cuda_graphs)
        """The batched decode's shapes: off ragged; on static (CUDA graphs on CUDA); auto
        static with graphs on CUDA, ragged elsewhere (graphs.py)."""
        self.vocoder_tf32 = switch("vocoder_tf32", vocoder_tf32)
        """The vocoder flow's float32 products in TF32 (vocoder.precision): auto on CUDA
        unless the weights are float32 (`vocoder_in_tf32`)."""
        self.tts_slot_tokens = _at_least("tts_slot_tokens", tts_slot_tokens, 1)
        """Tokens of each batched TTS slot (a speaker's TTS past within a turn); None:
        tts.TTS_TOKENS. A past that outgrows it goes on on the serial path."""
        self.decode_ahead = _at_least("decode_ahead", decode_ahead, 0)
        """Decode forwards the device may run beyond the host's reading of their tokens
        (decode.ahead); None: decode.CUDA_AHEAD on CUDA, 0 elsewhere."""
        self.slots = slots
        self.api = api
        self.text_only = text_only
        self.vocoder_batched = vocoder_batched
        """A batched step runs the vocoder once for all its speakers (else per speaker)."""
        self._batched_vocoder: Any = None
        self._vocoders: dict[bool, Any] = {}
        """The batched vocoders made, by static shapes or not (kept across mode switches)."""
        self.draws: dict[str, Any] = {}
        """Per device, the Generator of the sessions without a seed (decode.worker_generator)."""
        self.default_voice_setting = default_voice
        self.default_voice: Path | None = None
        # The default voice as the vocoder prepared it (vocoder.Voice), and as the chat path
        # did (it gives 16 kHz samples that the model code writes to a file: another voice):
        # kept, so that their sessions share them even when none is open.
        self.default_voice_kept: Any = None
        self.chat_voice_kept: Any = None
        self.layout = ""
        self.audio_on = False
        self.model: Any = None
        self.tokenizer: Any = None
        self.state: SharedState = SharedState(None)
        self.first_unit_samples = 16560
        self.unit_samples = 16000
        self._free: list[layouts.Handle] = []
        self._sessions: dict[int, MiniCPMOSession] = {}
        self._lock = threading.RLock()
        self._resident: MiniCPMOSession | _ChatState | None = None
        self.batched: BatchedStep | None = None
        """The batched stepper, once asked for (stepper())."""
        self.warm_unit_s: float | None = None
        """Seconds of the warm-up's unit alone: the session's cost estimate (cost_estimate)."""
        self.stepper_class = stepper_class
        """Builds the batched step (step.MiniCPMOStepper); None: sessions time-slice."""
        spare = _at_least("slot_spare_tokens", slot_spare_tokens, 1)
        spare = self.SLOT_SPARE_TOKENS if spare is None else spare
        self.kv_slot_tokens = (slot_tokens or context_tokens) + spare
        """Tokens each slot of the batched stepper's LLM KV cache holds: the context a
        session keeps (the cap, or a basic window's high watermark: slot_tokens) and room
        for the unit that crosses it. A session whose context outgrows its slot goes on
        on the serial path."""

    @classmethod
    def from_config(
        cls, config: Any, stepper_class: Callable[[MiniCPMOEngine], BatchedStep] | None = None
    ) -> MiniCPMOEngine:
        return cls(
            config.model_path,
            config.device or "cuda",
            config.attn,
            config.compile,
            slots=config.slots or cls.default_slots,
            api=config.minicpmo_api,
            text_only=config.text_only,
            default_voice=config.default_voice,
            vocoder_batched=not config.serial_vocoder,
            context_tokens=config.max_context_tokens,
            slot_tokens=slot_tokens(config),
            stepper_class=stepper_class,
            cuda_graphs=config.cuda_graphs,
            decode_ahead=config.decode_ahead,
            vocoder_tf32=config.vocoder_tf32,
            tts_slot_tokens=config.tts_slot_tokens,
            slot_spare_tokens=config.slot_spare_tokens,
        )

    @property
    def vocoder_in_tf32(self) -> bool:
        """Whether the vocoder's flow runs its float32 matrix products in TF32:
        `vocoder_tf32`, its auto on where the device is CUDA and the weights are not
        float32."""
        if self.vocoder_tf32 == "auto":
            return str(self.device).startswith("cuda") and self.dtype != "float32"
        return self.vocoder_tf32 == "on"

    @property
    def static_decode(self) -> bool:
        """The batched decode runs in static shapes (graphs.py)."""
        if self.cuda_graphs == "auto":
            return str(self.device).startswith("cuda")
        return self.cuda_graphs == "on"

    # ---- loading -------------------------------------------------------------------

    def load(self) -> None:
        """Check the directory and the runtime, load the model with the layout its code
        offers, build one duplex handle per slot. Raises EngineUnavailable."""
        if self.model is not None:
            return
        root = check_model_dir(self.model_path)
        self.layout = layouts.choose(root, self.api)
        check_runtime(self.device)
        problem = (
            "disabled by --text-only" if self.text_only else vocoder_problem(root, self.device)
        )
        self.audio_on = problem is None
        if problem:
            log.warning("minicpmo: text only, no audio deltas (%s)", problem)
        log.info(
            "minicpmo: loading %s on %s (%s); driving %s; %d slots",
            root,
            self.device,
            self.attn,
            layouts.DESCRIPTION[self.layout],
            self.slots,
        )
        import torch

        if self.dtype is not None:
            dtype = getattr(torch, self.dtype)
        else:
            dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        if self.device.startswith("cuda"):
            avoid_cudnn_attention(torch)
        try:
            with contextlib.ExitStack() as stack:
                if self.audio_on:
                    stack.enter_context(vocoder.installed(self.device, self.vocoder_in_tf32))
                first = getattr(self, f"_load_{self.layout}")(root, dtype)
        except ImportError as exc:
            raise EngineUnavailable(f"the model code in {root} cannot be imported: {exc}") from exc
        if self.audio_on and self.device.startswith("cuda"):
            log.info(
                "minicpmo: the vocoder flow's float32 matrix products in %s (--vocoder-tf32 %s)",
                "TF32" if self.vocoder_in_tf32 else "full float32",
                self.vocoder_tf32,
            )
        self.model = first.model
        self.tokenizer = first.tokenizer
        handles = [first] + [
            type(first)(layouts.clone_duplex(first.duplex)) for _ in range(self.slots - 1)
        ]
        self._free = handles
        self.state = SharedState(self.model)
        first_ms = int(getattr(first.duplex, "FIRST_CHUNK_MS", 1035))
        unit_ms = int(getattr(first.duplex, "CHUNK_MS", 1000))
        rate = int(getattr(first.duplex, "SAMPLE_RATE", 16000))
        self.first_unit_samples = rate * first_ms // 1000
        self.unit_samples = rate * unit_ms // 1000
        if self.audio_on:
            try:
                path, source = voice.resolve(self.default_voice_setting, root)
            except RuntimeError as exc:
                raise EngineUnavailable(f"no default voice: {exc}") from exc
            self.default_voice = path
            log.info("minicpmo: default voice %s (%s)", path, source)
        if self.compile:
            self.model.llm.forward = torch.compile(self.model.llm.forward)

    def _load_unified(self, root: Path, dtype: Any) -> layouts.Handle:
        module = import_module(root, "modeling_minicpmo_unified")
        model = self._from_pretrained(root, module.MiniCPMO, dtype)
        with contextlib.ExitStack() as stack:
            if not self.audio_on:
                stack.enter_context(layouts.suppressed(module.MiniCPMO, "init_token2wav"))
            model.init_unified(
                pt_path=None,
                preload_both_tts=False,
                duplex_config={
                    "generate_audio": self.audio_on,
                    "max_new_speak_tokens_per_chunk": MAX_SPEAK_TOKENS,
                },
                device=self.device,
                chat_vocoder="token2wav",
            )
        return layouts.UnifiedHandle(model.duplex)

    def _load_as_duplex(self, root: Path, dtype: Any) -> layouts.Handle:
        module = import_module(root, "modeling_minicpmo")
        model = self._from_pretrained(root, module.MiniCPMO, dtype)
        if self.audio_on:
            model.init_tts()
        # as_duplex() builds the vocoder again: the one just built is shared instead.
        with layouts.suppressed(module.MiniCPMO, "init_tts"):
            duplex = model.as_duplex(device=self.device)
        return layouts.AsDuplexHandle(duplex)

    def _load_duplex(self, root: Path, dtype: Any) -> layouts.Handle:
        module = import_module(root, "modeling_minicpmo")
        with contextlib.ExitStack() as stack:
            if not self.audio_on:
                stack.enter_context(layouts.suppressed(module.MiniCPMO, "init_tts"))
            # This class loads the weights itself (the only copy: nothing else is built).
            duplex = module.MiniCPMODuplex(
                name_or_path=str(root),
                device=self.device,
                generate_audio=self.audio_on,
                attn_implementation=self.attn,
            )
        if dtype != duplex.model.dtype:
            duplex.model.to(dtype)
        return layouts.DuplexHandle(duplex)

    def _from_pretrained(self, root: Path, cls: Any, dtype: Any) -> Any:
        """`cls`: a model class of the checkpoint's own code (a transformers model)."""
        config_module = import_module(root, "configuration_minicpmo")
        config = config_module.MiniCPMOConfig.from_pretrained(str(root))
        model = cls.from_pretrained(
            str(root), config=config, torch_dtype=dtype, attn_implementation=self.attn
        )
        return model.eval().to(self.device)

    #: What a slot holds beyond the context cap by default (--slot-spare-tokens): the unit
    #: that crosses it (its frames' slices, its speech, its deferred finalize). A unit that
    #: would pass it goes through the serial path.
    SLOT_SPARE_TOKENS = 1024

    def stepper(self) -> Stepper | None:
        """The batched step (step.py) when the engine holds several sessions and was given
        its class; built once, its LLM KV slot cache allocated now (slots x the context
        cap, logged)."""
        if self.slots <= 1 or self.stepper_class is None:
            return None
        if self.batched is None:
            self.batched = self.stepper_class(self)
            if self.model is not None:
                cache = self.batched.cache
                tts = self.batched.tts_cache()
                if tts is not None:
                    log.info("minicpmo: %s on %s", tts.describe("TTS"), self.device)
                kv = self.kv_figures()
                assert kv is not None
                more = (
                    f"; {kv.more_slots} more slots (LLM and TTS, {kv.slot_bytes / 2**20:.0f} "
                    "MiB each) would fit in the free memory"
                    if cache.device.type == "cuda"
                    else ""
                )
                log.info(
                    "minicpmo: batched steps; %s on %s%s", cache.describe("LLM"), self.device, more
                )
        assert isinstance(self.batched, Stepper)
        return self.batched

    def kv_figures(self) -> KvFigures | None:
        """The batched step's KV slots (None before the stepper is built, or without one):
        the LLM's tokens a slot; its bytes are the LLM's and the TTS's caches of one slot
        (a session takes a row of each), so the slots that would fit count both."""
        stepper = self.batched
        cache = getattr(stepper, "_cache", None) if stepper is not None else None
        if cache is None:
            return None
        per_slot = cache.slot_bytes
        tts = getattr(getattr(stepper, "tts", None), "cache", None)
        if tts is not None:
            per_slot += tts.slot_bytes
        return KvFigures(cache.slots, cache.max_len, per_slot, _more_slots(cache.device, per_slot))

    # ---- sessions --------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self, session: MiniCPMOSession | _ChatState) -> Iterator[None]:
        """Hold the engine with `session`'s state on the shared model."""
        with self._lock:
            if self._resident is not session:
                if self._resident is not None:
                    self._resident.shared = self.state.save()
                self.state.load(session.shared)
                self._resident = session
            yield

    def forget(self, session: MiniCPMOSession | _ChatState) -> None:
        """`session` leaves the model (its state was cleared, nothing to save)."""
        with self._lock:
            if self._resident is session:
                self._resident = None

    def open_session(self, session_id: str, mode: str) -> MiniCPMOSession:
        if mode not in ("audio", "video"):
            raise ValueError(f"mode {mode!r} not served by a duplex session")
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.slots} duplex slots of the model are in use")
            session = MiniCPMOSession(self, self._free.pop(), session_id, mode)
            self._sessions[id(session)] = session
            return session

    def vocoder_cache_bytes(self, session: MiniCPMOSession) -> int:
        """Bytes of `session`'s own vocoder caches (its stream's flow and HiFT caches and its
        copies of the voice's; a voice shared with other sessions is voice_bytes'; 0 without
        speech)."""
        tok = getattr(getattr(self.model, "tts", None), "audio_tokenizer", None)
        if tok is None:
            return 0
        d = session.handle.duplex
        base = getattr(d, vocoder.KEPT, None)
        with self.using(session):
            return vocoder.cache_bytes(
                tok.stream_cache,
                tok.hift_cache_dict,
                None if isinstance(base, vocoder.Voice) else base,
                getattr(d, "hift_cache_base", None),
            )

    def voice_bytes(self) -> int:
        """Bytes of the voices the vocoder keeps for their sessions (vocoder.Voice)."""
        tok = getattr(getattr(self.model, "tts", None), "audio_tokenizer", None)
        return 0 if tok is None else vocoder.voice_bytes(tok)

    def release(self, session: MiniCPMOSession) -> None:
        with self._lock:
            if self._sessions.pop(id(session), None) is not None:
                self._free.append(session.handle)

    def vision_tokens(self, images: list[Any], max_slice_nums: int) -> int:
        """Context tokens the images take: per image 1 + M*N slices from the processor's
        slice grid, each the resampler's queries plus two markers."""
        if not images:
            return 0
        processor = getattr(self.model, "processor", None)
        image_processor = getattr(processor, "image_processor", None)
        per_slice = int(getattr(self.model.config, "query_num", 64)) + 2
        total = 0
        for image in images:
            grid = None
            if image_processor is not None:
                grid = image_processor.get_sliced_grid(image.size, max_slice_nums)
            total += (1 + (grid[0] * grid[1] if grid else 0)) * per_slice
        return total

    def warmup(self) -> GenerateResult:
        """A unit through a full session (Engine.warmup), the vocoder's first calls, then
        the batched step's CUDA graphs (each bucket of its decode and TTS steps)."""
        t0 = time.perf_counter()
        result = super().warmup()
        self.warm_unit_s = time.perf_counter() - t0
        if self.audio_on:
            self._warm_vocoder()
        if self.batched is not None:
            t0 = time.perf_counter()
            done = self.batched.capture_graphs()
            if any(done.values()):
                log.info(
                    "minicpmo: CUDA graphs captured in %.2f s: %s",
                    time.perf_counter() - t0,
                    ", ".join(f"{n} {part}" for part, n in done.items()),
                )
        return result

    def cost_estimate(self, mode: str, warmup_s: float) -> float:
        """The warm-up's unit alone (warm_unit_s): the whole warm-up also warms the vocoder
        and captures the step's graphs (tens of seconds, once per worker), which no
        session's unit costs; a chat turn holds one engine thread (Engine's)."""
        if mode == "chat" or self.warm_unit_s is None:
            return super().cost_estimate(mode, warmup_s)
        return self.warm_unit_s

    def _warm_vocoder(self) -> None:
        """The default voice prepared and a chunk of silence spoken (then a flush), in a state
        of its own, alone and, on a batched worker, two at once: the vocoder's first calls
        are slow (3.8 s against 0.07 s for the tiny one on this CPU: kernels picked, buffers
        made, its conformer compiled for one row and for several, last chunk or not), and a
        speaking unit that paid for them would hold every session of its step past the
        edge's watchdog."""
        import torch

        tok = self.model.tts.audio_tokenizer
        holder = _ChatState(self.state.fresh())
        chunks = [([SILENCE_TOKEN] * (CHUNK_TOKENS + LOOKAHEAD_TOKENS), False)]
        chunks.append(([SILENCE_TOKEN] * LOOKAHEAD_TOKENS, True))
        t0 = time.perf_counter()
        with self.using(holder):
            try:
                voice = str(self.default_voice)
                # The package's conformer is compiled (torch.compile) with a guard on whether
                # its caches are inference tensors. set_stream_cache makes them in inference
                # mode; the public code starts each session (and turn) from copies made
                # outside it, so a session's first chunk gets plain tensors: without this
                # variant warmed, that chunk recompiled (~5 s here: the unit's watchdog
                # fired, the session ended in an error, the worker went NOT_SERVING).
                for plain, run in ((False, chunks), (True, chunks), (True, chunks[1:])):
                    tok.set_stream_cache(voice)
                    # kept for the worker's life: its sessions' voice unless they bring one
                    self.default_voice_kept = tok.voice
                    if plain:
                        with torch.inference_mode(False):
                            tok.stream_cache = {k: v.clone() for k, v in tok.stream_cache.items()}
                    for tokens, last in run:
                        tok.stream(tokens, last_chunk=last)
                if self.slots > 1 and self.vocoder_batched:
                    self._speak_batched(voice, 2, chunks)
            finally:
                self.state.clear()
                self.forget(holder)
        log.info("minicpmo: vocoder warmed in %.2f s", time.perf_counter() - t0)
        if self.slots > 1 and self.vocoder_batched and self.batched_vocoder().flow.graphs:
            t0 = time.perf_counter()
            try:
                counts = self.warm_vocoder_rows()
            except Exception as exc:  # what it makes ahead is made at first use otherwise
                log.warning(
                    "minicpmo: the batched vocoder's buckets were not made ahead (%s: %s); "
                    "each is made at its first call",
                    type(exc).__name__,
                    exc,
                )
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return
            log.info(
                "minicpmo: the batched vocoder's graphs captured for %s rows in %.2f s",
                "/".join(map(str, counts)),
                time.perf_counter() - t0,
            )

    def warm_vocoder_rows(self) -> list[int]:
        """Each row bucket of the batched vocoder up to the slots (as many rows as the
        bucket's largest call here) through a turn of the default voice: four full chunks
        (the flow's cache grows to the length the package trims it to by the third) and a
        last one, so the steady chunks' buckets of the flow and the HiFT, and their CUDA
        graphs, are made before a session's step meets them (a custom voice's cache length,
        a flush's or a last chunk's length may still meet a new bucket; a longer voice's
        keys grow the flow's arena, which drops what was made on it). The row counts, in
        ascending order."""
        from omnifabric.worker.engines.minicpmo.vocoder_flow import bucket

        full = ([SILENCE_TOKEN] * (CHUNK_TOKENS + LOOKAHEAD_TOKENS), False)
        turn = [full] * 4 + [([SILENCE_TOKEN] * LOOKAHEAD_TOKENS, True)]
        slots = self.slots
        counts = sorted({min(bucket(n, 1, 1)[0], slots) for n in range(1, slots + 1)})
        holder = _ChatState(self.state.fresh())
        with self.using(holder):
            try:
                # The largest first: the flow's key arena grows to its size (a larger
                # bucket replaces the arena and drops what was made on it), then every
                # count's buckets are made on that arena and kept.
                for rows in [counts[-1], *reversed(counts)]:
                    self._speak_batched(str(self.default_voice), rows, turn)
            finally:
                self.state.clear()
                self.forget(holder)
        return counts

    def _speak_batched(self, voice: str, rows: int, chunks: list[tuple[list[int], bool]]) -> None:
        """`rows` streams of `voice` at once through the batched vocoder, `chunks` in turn
        (the resident state's vocoder caches, copied for each row after the first)."""
        from omnifabric.worker.engines.minicpmo.vocoder_batch import VocoderJob

        tok = self.model.tts.audio_tokenizer
        tok.set_stream_cache(voice)
        jobs = []
        for k in range(rows):
            job = VocoderJob.of(tok, None)
            if k:
                job.stream_cache = {key: v.clone() for key, v in job.stream_cache.items()}
                job.hift_cache = {key: v.clone() for key, v in job.hift_cache.items()}
            jobs.append(job)
        for tokens, last in chunks:
            for job in jobs:
                job.tokens, job.last_chunk = tokens, last
            self.batched_vocoder().run(jobs)

    def batched_vocoder(self) -> Any:
        """The vocoder batched across sessions (vocoder_batch.BatchedVocoder), made once per
        `--cuda-graphs` setting and kept: its flow matching in static shapes where the
        decode's are, replayed as CUDA graphs on CUDA."""
        static = self.static_decode
        if self._batched_vocoder is None or self._batched_vocoder.flow.static != static:
            made = self._vocoders.get(static)
            if made is None:
                from omnifabric.worker.engines.minicpmo.vocoder_batch import BatchedVocoder

                tok = self.model.tts.audio_tokenizer
                made = self._vocoders[static] = BatchedVocoder(tok, static=static, graphs=static)
            self._batched_vocoder = made
        return self._batched_vocoder

    # ---- chat --------------------------------------------------------------------------

    def chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        """One chat turn through the model's streaming path: streaming_prefill per message,
        then streaming_generate, text (and speech) as it comes. With functions, they go in
        through the checkpoint's chat template and the model's calls come out of its text
        (``tool_turn``, ``calls_from``)."""
        if not turn.messages or turn.messages[-1].role not in ("user", "tool"):
            raise ValueError("the last message must be the user's (or a function's output)")
        if not turn.tools and not any(m.role == "tool" or m.tool_calls for m in turn.messages):
            yield from self._chat(turn)
            return
        model_turn, notes = tool_turn(self.tokenizer, turn)
        chunks = self._chat(model_turn)
        if notes or (turn.tools and turn.tool_choice.allows_calls()):
            chunks = calls_from(chunks, turn, notes)
        yield from chunks

    def _chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        from omnifabric.worker.engines.minicpmo.chat import stream_turn

        # The chat's own values of the shared-model state, swapped like a session's, so a
        # duplex unit of another slot between two chunks sees nothing of the chat.
        holder = _ChatState(self.state.fresh())
        stream = stream_turn(self, turn)
        try:
            while True:
                with self.using(holder):
                    chunk = next(stream, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            with self.using(holder):
                stream.close()
                self.state.clear()
                self.model.reset_session(reset_token2wav_cache=True)
                self.forget(holder)

    @staticmethod
    def chat_content(message: ChatMessage) -> list[Any]:
        from PIL import Image

        content: list[Any] = []
        for part in message.parts:
            if isinstance(part, bytes):
                content.append(Image.open(io.BytesIO(part)).convert("RGB"))
            else:
                content.append(part)  # text, or 16 kHz float32 audio as the model takes it
        return content
