"""The vocoder MiniCPM-o speaks through (`stepaudio2.Token2wav` of minicpmo-utils 1.0.7), on the
engine's device, CPU included.

The package's Token2wav hard-codes CUDA (`torch.cuda.current_device()`, `.cuda()` in its prompt
preparation) and reads the voice with `torchaudio.load`, which needs torchcodec from torchaudio
2.9 on. `DeviceToken2wav` is that class with a device: its own constructor and voice preparation,
everything else (the streaming step, cache trims, the bounded causal HiFT) the package's. The
model code builds its vocoder with `from stepaudio2 import Token2wav`; `installed(device)` puts
this class there while the engine loads the model.

More adaptations, none changing the arithmetic:
- The flow-matching scratch buffers are sized from the estimator (the package allocates the
  released 16 blocks x 8 heads), so smaller random-weight flows for tests run too.
- A voice is cut to its first `VOICE_MAX_S` seconds: the estimator's key cache holds 1000 mel
  frames (the voice, 100 frames of history and a chunk); a longer voice fails inside the package.
- Stand-in ONNX parts (tools/vocoder_assets.py, metadata `omnifabric.stand_in`) run here: the
  speech tokenizer stand-in is a plain graph s3tokenizer cannot convert.
- The HiFT's STFT window and noise table live on the vocoder's device (`device_tables`): the
  package copies them there on every use.

Voices are shared between sessions (`Voice`, `shared_base`). The model code prepares a
session's voice afresh at its start (it empties the vocoder's prepared voices, then
`set_stream_cache`: the speaker embedding, the speech tokens, then the flow over the whole
voice, 1.7 s on this 2-core CPU at the released sizes) and keeps a copy of the flow caches
for the session's life (`flow_cache_base`, each turn starts from a copy of it):
133 MiB a session at the released sizes with 5 flow steps and the default voice, the same
for every session of that voice. Here a voice is prepared once per audio content and kept
while a session holds it; the sessions' bases are that one copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: What Token2wav needs in its folder.
REQUIRED = (
    "speech_tokenizer_v2_25hz.onnx",
    "campplus.onnx",
    "flow.yaml",
    "flow.pt",
    "config.yaml",
    "hift.pt",
    "hift_original.pt",
)
#: The metadata key of stand-in ONNX parts (tools/vocoder_assets.py).
STAND_IN_KEY = "omnifabric.stand_in"
#: Mel frames the estimator's key cache holds (the package's scratch buffer), the history the
#: stream keeps after the voice, and the largest chunk (28 tokens, x2 upsampling).
CACHE_FRAMES, HISTORY_FRAMES, CHUNK_FRAMES = 1000, 100, 2 * 28
#: The longest voice (reference audio) the vocoder takes, in seconds (50 mel frames a second).
VOICE_MAX_S = (CACHE_FRAMES - HISTORY_FRAMES - CHUNK_FRAMES - 8) // 50


def problem(folder: Path) -> str | None:
    """Why the vocoder cannot run from `folder`, or None when it can."""
    try:
        importlib.import_module("stepaudio2")
    except ImportError as exc:
        return f"the vocoder package cannot be imported ({exc}): bash tools/dev minicpmo --vocoder"
    if not folder.is_dir():
        return f"{folder} is missing (the vocoder's weights)"
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        return f"{folder} lacks {', '.join(missing)}"
    return None


def stand_in(path: Path) -> str | None:
    """Which part an ONNX file stands in for (tools/vocoder_assets.py), or None when real."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((p.value for p in model.metadata_props if p.key == STAND_IN_KEY), None)


class StandInTokenizer:
    """The speech tokenizer stand-in: a 128-bin log mel at 100 Hz -> ids at 25 Hz."""

    def __init__(self, path: Path) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def quantize(self, mels: Any, lens: Any) -> tuple[Any, Any]:
        import torch

        mel = mels[:1, :, : int(lens[0])].float().cpu().numpy()
        ids = self.session.run(None, {"feats": mel})[0]
        tokens = torch.as_tensor(ids, dtype=torch.int32, device=mels.device)
        return tokens, torch.tensor([tokens.shape[1]], dtype=torch.int32, device=mels.device)


def size_scratch(flow: Any) -> None:
    """Size the flow-matching scratch buffers from the estimator: [timesteps, depth, 2 (cfg),
    2 x hidden, kernel - 1] for the convolutions, [..., heads, frames, 2 x head dim] for keys
    and values. The released sizes give the package's own shapes."""
    cfm = flow.decoder
    dit = cfm.estimator
    block = dit.blocks[0]
    depth, heads, head_dim = len(dit.blocks), block.attn.num_heads, block.attn.head_dim
    conv = 2 * block.conv.in_channels
    steps = cfm.cnn_cache_buffer.shape[0]
    like = cfm.att_cache_buffer
    cfm.cnn_cache_buffer = like.new_zeros((steps, depth, 2, conv, 2))
    cfm.att_cache_buffer = like.new_zeros((steps, depth, 2, heads, CACHE_FRAMES, 2 * head_dim))
    dit.cnn_cache_buffer = like.new_zeros((depth, 2, conv, 2))
    dit.att_cache_buffer = like.new_zeros((depth, 2, heads, CACHE_FRAMES, 2 * head_dim))


def make(
    model_path: str | Path,
    float16: bool = False,
    n_timesteps: int = 10,
    device: str = "cuda",
    tf32: bool = False,
) -> Any:
    """A DeviceToken2wav on `device` (the class is made on first use: it derives from the
    package's, which imports torch and torchaudio); `tf32`: its flow's float32 matrix
    products run in TF32 (precision())."""
    global _CLASS, _BASE
    if _CLASS is None:
        from stepaudio2.token2wav import Token2wav

        _BASE = Token2wav
        _CLASS = type(
            "DeviceToken2wav",
            (Token2wav,),
            {
                "__init__": _init,
                "_prepare_prompt": _prepare_prompt,
                "set_stream_cache": _set_stream_cache,
                "stream": _stream,
                "__doc__": __doc__,
            },
        )
    made = _CLASS(model_path, float16=float16, n_timesteps=n_timesteps, device=device)
    made.tf32 = tf32
    flow = made.flow
    for name in FLOW_CALLS:  # the flow's entry points in the vocoder's precision
        setattr(flow, name, _in_precision(made, getattr(flow, name)))
    return made


#: The flow's methods Token2wav calls (whole utterance, a voice's cache, a chunk).
FLOW_CALLS = ("inference", "setup_cache", "inference_chunk")


def _in_precision(t2w: Any, method: Any) -> Any:
    import functools

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with precision(t2w):
            return method(*args, **kwargs)

    return call


_CLASS: Any = None
#: The package's Token2wav (DeviceToken2wav's base), once made.
_BASE: Any = None


def _init(
    self: Any, model_path: Any, float16: bool = False, n_timesteps: int = 10, device: str = "cuda"
) -> None:
    """Token2wav's construction on `device`, stand-in ONNX parts run as they are marked."""
    import onnxruntime
    import s3tokenizer
    import torch
    from stepaudio2.causal_vocoder.bounded_vocoder import BoundedVocoder
    from stepaudio2.token2wav import _load_config, load_causal_vocoder

    self.float16 = float16
    self.n_timesteps = int(n_timesteps)
    if self.n_timesteps <= 0:
        raise ValueError("n_timesteps must be positive")
    self.device = torch.device(device)
    folder = Path(model_path).resolve(strict=True)
    self.model_path = folder
    why = problem(folder)
    if why:
        raise FileNotFoundError(why)
    tokenizer = folder / "speech_tokenizer_v2_25hz.onnx"
    if stand_in(tokenizer):
        self.audio_tokenizer = StandInTokenizer(tokenizer)
    else:
        self.audio_tokenizer = s3tokenizer.load_model(str(tokenizer)).to(self.device).eval()
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    self.spk_model = onnxruntime.InferenceSession(
        str(folder / "campplus.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
    )
    flow = _load_config(folder / "flow.yaml")["flow"]
    if float16:
        flow.half()
    state = torch.load(folder / "flow.pt", map_location="cpu", weights_only=True)
    flow.load_state_dict(state, strict=True)
    size_scratch(flow)
    self.flow = flow.to(self.device).eval()
    self.hift, self.vocoder_checkpoint, self.vocoder_config = load_causal_vocoder(
        folder, self.device
    )
    device_tables(self.hift, self.device)
    self.bounded_vocoder = BoundedVocoder(self.hift)
    self.sample_rate, self.hop_samples = 24000, 480
    self.vocoder_delay_frames = (
        self.hift.f0_predictor.condnet[0].causal_padding + self.hift.conv_pre_look_right + 1
    )
    if self.vocoder_delay_frames != 8:
        raise ValueError(f"the causal HiFT must delay 8 frames, not {self.vocoder_delay_frames}")
    self.vocoder_delay_samples = self.vocoder_delay_frames * self.hop_samples
    self.source_cache_len = self.vocoder_delay_samples
    self.original_vocoder_checkpoint = folder / "hift_original.pt"
    self.original_hift = None
    self.cache = {}
    self.stream_cache = None
    self.hift_cache_dict = {}
    self._stream_prompt = None
    self.voices = weakref.WeakValueDictionary()  # voice_key -> Voice
    self.voice = None  # the Voice last set


def device_tables(hift: Any, device: Any) -> None:
    """The HiFT's STFT window and its source's noise table (300 s x 9 harmonics, 259 MB in
    float32) on the vocoder's device: the package keeps both as plain CPU tensors and copies
    what it uses to the device on every STFT, ISTFT and source block, a copy the host waits
    for each time. The same values; only where they live."""
    hift.stft_window = hift.stft_window.to(device)
    oscillator = hift.m_source.l_sin_gen
    if getattr(oscillator, "sine_waves", None) is not None:
        oscillator.sine_waves = oscillator.sine_waves.to(device)


def owned(cache: dict[str, Any], steps: int) -> dict[str, Any]:
    """A stream cache whose tensors own their memory: the package's flow returns views of
    its scratch buffers (the next session's call overwrites them), and its estimator caches
    span every scratch timestep (16) where `steps` are used."""
    out = {}
    for key, value in cache.items():
        if key.startswith("estimator_"):
            value = value[:steps].clone()
        out[key] = value
    return out


def cache_bytes(*caches: Any) -> int:
    """Bytes of the tensors in vocoder caches (dicts of tensors, None counts 0)."""
    total = 0
    for cache in caches:
        for value in (cache or {}).values():
            if hasattr(value, "element_size"):
                total += value.element_size() * value.nelement()
    return total


@contextlib.contextmanager
def precision(t2w: Any) -> Iterator[None]:
    """While the vocoder `t2w`'s flow works (its entry points, FLOW_CALLS, and the batched
    vocoder's flow): its float32 matrix products in TF32 where it was made so (`tf32`), the
    process's setting put back after. The flow is 88 GFLOP a session and 1 s chunk at the
    released sizes with 5 Euler steps (counted with torch's FLOP counter; 96 % of it the DiT
    estimator, nearly all matrix products): at 64 speakers 5.6 TFLOP a step, which full
    float32 runs at a GPU's float32 rate (67 TFLOPS on an H200) and TF32 on its tensor cores
    (495 dense). TF32 reads float32 operands with 10 mantissa bits, the width the package's
    own float16 option runs the whole flow in. The HiFT stays out: its few matrix products
    are small, and one of them predicts the F0 its sine source integrates into a phase, where
    a rounded pitch drifts the waveform sample by sample; its convolutions, most of its work,
    run in TF32 anyway (PyTorch's default for them). The public demo turns TF32 on for every
    float32 product with its compile option. No effect on a CPU."""
    if not getattr(t2w, "tf32", False):
        yield
        return
    import torch

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


class Voice(dict):
    """A voice's flow caches as `set_stream_cache` leaves them (the caches every turn of its
    sessions starts from; never written), with the voice as the package prepares it
    (`prepared`: speech tokens, their lengths, speaker embedding, mel, mel lengths). One per
    audio content and vocoder, kept by the vocoder while anything else holds it (`voices`)."""

    prepared: tuple[Any, ...]


def voice_key(prompt_wav: Any) -> str:
    """What identifies a voice: its audio (the sample rate and the samples as soundfile reads
    them), not its path: the engine writes each session's own voice to a new file, and the
    same recording written twice reads the same."""
    import numpy as np
    import soundfile

    data, rate = soundfile.read(str(prompt_wav), dtype="float32", always_2d=True)
    digest = hashlib.sha256(np.ascontiguousarray(data).tobytes())
    digest.update(f"{rate}/{data.shape[1]}".encode())
    return digest.hexdigest()


def _set_stream_cache(self: Any, prompt_wav: Any) -> tuple[Any, Any]:
    """The package's: the voice prepared (once per audio content while a session holds it:
    `Voice`), the stream's flow caches a copy of the voice's own (owned, see owned()), the
    HiFT's reset. `self.voice` is the voice last set (shared_base finds it there)."""
    import torch

    prompt_wav = str(prompt_wav)
    key = voice_key(prompt_wav)
    voice = self.voices.get(key)
    if voice is None:
        _BASE.set_stream_cache(self, prompt_wav)
        voice = Voice(owned(self.stream_cache, self.n_timesteps))
        voice.prepared = self.cache[prompt_wav]
        self.voices[key] = voice
    else:  # the package's steps but the voice's preparation and its flow pass
        if self.cache is None:
            self.cache = {}
        self.cache[prompt_wav] = voice.prepared
        self.bounded_vocoder.reset()
        self.hift_cache_dict = self.bounded_vocoder.cache
        self.hift_cache_dict["first_chunk"] = torch.ones(1, dtype=torch.long)
        self._stream_prompt = prompt_wav
    self.stream_cache = {}
    for name, value in voice.items():  # each an inference tensor or not as the voice's is
        with torch.inference_mode(value.is_inference()):
            self.stream_cache[name] = value.clone()
    self.voice = voice
    return self.stream_cache, self.hift_cache_dict


def shared_base(t2w: Any, base: Any) -> Any:
    """`base` (a session's copy of its voice's flow caches, as the model code keeps it) or,
    where it holds what the voice `t2w` set last holds, that voice itself: one copy of a
    voice's caches for all its sessions. Compared value by value (once per session start)."""
    import torch

    voice = getattr(t2w, "voice", None)
    if voice is None or base is None or base is voice or base.keys() != voice.keys():
        return voice if base is voice else base
    for name, value in voice.items():
        other = base[name]
        same = (other.shape, other.dtype, other.device) == (value.shape, value.dtype, value.device)
        if not (same and torch.equal(other, value)):
            return base
    return voice


def share_kept(model: Any, owner: Any) -> None:
    """After the model code prepared a session's voice: the flow caches it keeps for the
    session's turns (`flow_cache_base`, an attribute of the duplex `owner` or a key of the
    chat's `token2wav_cache` dict) become the voice's shared copy (shared_base)."""
    t2w = getattr(getattr(model, "tts", None), "audio_tokenizer", None)
    if t2w is None or owner is None:
        return
    if isinstance(owner, dict):
        if owner.get(KEPT) is not None:
            owner[KEPT] = shared_base(t2w, owner[KEPT])
    elif getattr(owner, KEPT, None) is not None:
        setattr(owner, KEPT, shared_base(t2w, getattr(owner, KEPT)))


#: Where the model code keeps a session's copy of its voice's flow caches.
KEPT = "flow_cache_base"


def voice_bytes(t2w: Any) -> int:
    """Bytes of the voices the vocoder `t2w` keeps (shared by their sessions)."""
    return cache_bytes(*getattr(t2w, "voices", {}).values())


def _stream(self: Any, generated_speech_tokens: Any, *args: Any, **kwargs: Any) -> Any:
    """The package's, its flow cache owned afterwards (see owned())."""
    out = _BASE.stream(self, generated_speech_tokens, *args, **kwargs)
    self.stream_cache = owned(self.stream_cache, self.n_timesteps)
    return out


def _prepare_prompt(self: Any, prompt_wav: Any) -> tuple[Any, ...]:
    """The voice's speech tokens, speaker embedding and 24 kHz mel (as the package makes
    them, read with soundfile and resampled by torchaudio's functional resampler)."""
    import s3tokenizer
    import soundfile
    import torch
    import torchaudio.compliance.kaldi as kaldi
    import torchaudio.functional as taf
    from stepaudio2.flashcosyvoice.utils.audio import mel_spectrogram

    data, rate = soundfile.read(str(prompt_wav), dtype="float32", always_2d=True)
    limit = VOICE_MAX_S * rate
    if data.shape[0] > limit:
        log.warning("vocoder: voice %s cut to its first %d s", prompt_wav, VOICE_MAX_S)
        data = data[:limit]
    wave = torch.from_numpy(data.T.copy())  # [channels, T]
    audio = wave[0] if rate == 16000 else taf.resample(wave[:1], rate, 16000)[0]
    mels, lens = s3tokenizer.padding([s3tokenizer.log_mel_spectrogram(audio)])
    tokens, token_lens = self.audio_tokenizer.quantize(mels.to(self.device), lens.to(self.device))
    feats = kaldi.fbank(audio[None], num_mel_bins=80, dither=0, sample_frequency=16000)
    feats = feats - feats.mean(dim=0, keepdim=True)
    name = self.spk_model.get_inputs()[0].name
    embedding = self.spk_model.run(None, {name: feats[None].cpu().numpy()})[0]
    spk = torch.tensor(embedding, device=self.device)
    mono = wave.mean(dim=0, keepdim=True)
    if rate != 24000:
        mono = taf.resample(mono, rate, 24000)
    mel = mel_spectrogram(mono).transpose(1, 2).to(self.device)  # [1, T, 80]
    frames = tokens.shape[1] * self.flow.up_rate
    mel = torch.nn.functional.pad(mel, (0, 0, 0, frames - mel.shape[1]), mode="replicate")
    lengths = torch.tensor([mel.shape[1]], dtype=torch.int32, device=self.device)
    return tokens, token_lens, spk, mel, lengths


@contextlib.contextmanager
def installed(device: str, tf32: bool = False) -> Iterator[None]:
    """While the model code builds its vocoder, `stepaudio2.Token2wav` is DeviceToken2wav on
    `device`, in TF32 where `tf32` (the package's class again afterwards)."""
    import functools

    import stepaudio2

    before = stepaudio2.Token2wav
    stepaudio2.Token2wav = functools.partial(make, device=device, tf32=tf32)
    try:
        yield
    finally:
        stepaudio2.Token2wav = before
