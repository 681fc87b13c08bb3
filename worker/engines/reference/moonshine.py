"""Moonshine base-en (speech recognition, 61M parameters, MIT) in torch, from the int8 ONNX
Runtime files that the ``moonshine-cpp`` package (0.1.4, MIT) ships in ``models/base-en``.

The package's own library is not used (it is a C++ build that runs the files through ONNX
Runtime, ~30 ms per decoded token on one core here, because every call dequantizes every
weight). We read the two ORT-format files (flatbuffers, through onnxruntime's schema module),
dequantize once, and fill transformers' ``MoonshineForConditionalGeneration``: ~9 ms per token
and ~30 ms of encoder for 2 s of speech on one core, with the same transcripts as ONNX Runtime
on 280 of 280 test utterances (logits within 1.2e-4).

What the files hold, as their graphs show (checked at load; anything unexpected raises):
- weights are per-tensor int8: ``W_quantized`` -> Cast(float) -> Mul(``W_scale``) ->
  Add(``W_zero_point``), so w = q * scale + offset;
- a weight's name is the node that consumes it: ``/layers.N/self_attn/q_proj/MatMul`` is
  encoder layer N's q projection, ``/model/decoder/layers.N/...`` the decoder's; MatMul
  weights are [in, out] (transposed for nn.Linear); ``dense``/``up_proj``/``down_proj`` are
  HF's ``o_proj``/``fc1``/``fc2``; the token embedding also feeds the logits (tied);
- the group norm's affine parameters are the two anonymous [416, 1] operands of its Mul and Add;
- hidden 416, 8 + 8 layers, 8 heads of 52, feed-forward 1664 (SwiGLU in the decoder),
  rotary on 32 of the 52 head dimensions (theta 10000, checked against the graph's
  inverse frequencies), vocabulary 32768 (32000 pieces in ``tokenizer.bin``).

``tokenizer.bin`` is a list of pieces (a length byte, 0x80 set for a second length byte, then
the bytes); ids 3-258 are byte fallbacks, "\u2581" marks a space, 1 starts and 2 ends a
transcript. Text is encoded back into ids (for ``score``) SentencePiece-style: characters
merged pairwise, the pair making the piece of lowest id first.
"""

from __future__ import annotations

import importlib.util
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.models.moonshine.configuration_moonshine import MoonshineConfig
from transformers.models.moonshine.modeling_moonshine import MoonshineForConditionalGeneration

from omnifabric.worker.engines.reference.asr import (
    BEAMS,
    Hypothesis,
    beam_search,
    read_draft,
    summed_logprob,
    widen,
)
from omnifabric.worker.engines.reference.linears import use_onednn, wants_bf16

SAMPLE_RATE = 16000
PACKAGE = "moonshine_cpp"
MODEL_FOLDER = "models/base-en"
FILES = ("encoder_model.ort", "decoder_model_merged.ort", "tokenizer.bin")
START, END = 1, 2
BYTE_IDS = range(3, 259)
TOKENS_PER_SECOND = 6.5
"""Decoding stops after this many tokens per second of audio (plus 4): no loop runs long."""
MIN_LOOP = 4
"""Repeated tokens (over all copies past the first) that count as a decoding loop."""
HIDDEN = 416
HEAD_DIM = 52
ENCODER_STRIDE = 384
"""Audio samples per encoder frame (three convolutions with strides 64, 3 and 2)."""

CONFIG = {
    "vocab_size": 32768,
    "hidden_size": HIDDEN,
    "intermediate_size": 1664,
    "encoder_num_hidden_layers": 8,
    "decoder_num_hidden_layers": 8,
    "encoder_num_attention_heads": 8,
    "decoder_num_attention_heads": 8,
    "encoder_num_key_value_heads": 8,
    "decoder_num_key_value_heads": 8,
    "encoder_hidden_act": "gelu",
    "decoder_hidden_act": "silu",
    "partial_rotary_factor": 0.62,
    # Upstream pads heads to 56 for GPU kernels: a numerical no-op that costs ~1 ms a token
    # on CPU (the cross-attention cache is padded again every step).
    "pad_head_dim_to_multiple_of": None,
    "rope_theta": 10000.0,
    "max_position_embeddings": 194,
    "attention_bias": False,
    "bos_token_id": START,
    "decoder_start_token_id": START,
    "eos_token_id": END,
    "tie_word_embeddings": True,
}
_RENAME = {"dense": "o_proj", "up_proj": "fc1", "down_proj": "fc2"}
_LINEAR = re.compile(
    r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn|encoder_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|fc1|fc2)\.weight"
)


def model_dir() -> Path:
    """The folder with the model files, found without importing the package (its import
    loads native libraries we do not use)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("moonshine-cpp is not installed (pip install moonshine-cpp==0.1.4)")
    folder = Path(list(spec.submodule_search_locations)[0]) / MODEL_FOLDER
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"moonshine-cpp has no {', '.join(missing)} in {folder}")
    return folder


def model_installed() -> bool:
    try:
        model_dir()
    except FileNotFoundError:
        return False
    return True


# --- the ORT-format files -------------------------------------------------------------------


@dataclass
class _Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)


def _text(raw: bytes | None) -> str:
    return raw.decode() if raw is not None else ""


def read_ort(path: Path) -> tuple[dict[str, np.ndarray], list[_Node]]:
    """Initializers and nodes of an ORT-format model, subgraphs (an If's branches) included."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import (
        AttributeType,
        InferenceSession,
        TensorDataType,
    )

    kinds = TensorDataType.TensorDataType
    dtypes = {
        kinds.FLOAT: np.float32,
        kinds.INT8: np.int8,
        kinds.UINT8: np.uint8,
        kinds.INT32: np.int32,
        kinds.INT64: np.int64,
        kinds.BOOL: np.bool_,
        kinds.FLOAT16: np.float16,
        kinds.DOUBLE: np.float64,
    }
    attr = AttributeType.AttributeType

    def tensor(t: Any) -> np.ndarray:
        name = _text(t.Name())
        dims = [t.Dims(j) for j in range(t.DimsLength())]
        dtype = dtypes.get(t.DataType())
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has unsupported type {t.DataType()}")
        if t.RawDataIsNone():
            if dims and int(np.prod(dims)) != 0:
                raise ValueError(f"{path.name}: tensor {name} keeps its data elsewhere")
            return np.zeros(dims, dtype)
        return np.frombuffer(t.RawDataAsNumpy().tobytes(), dtype).reshape(dims).copy()

    def value(a: Any) -> Any:
        kind = a.Type()
        if kind == attr.INT:
            return a.I()
        if kind == attr.FLOAT:
            return a.F()
        if kind == attr.INTS:
            return [a.Ints(i) for i in range(a.IntsLength())]
        return None  # strings, tensors, graphs: not needed to map the weights

    buffer = bytearray(path.read_bytes())
    if not InferenceSession.InferenceSession.InferenceSessionBufferHasIdentifier(buffer, 0):
        raise ValueError(f"{path} is not an ORT-format model")
    model = InferenceSession.InferenceSession.GetRootAsInferenceSession(buffer, 0).Model()
    inits: dict[str, np.ndarray] = {}
    nodes: list[_Node] = []

    def walk(graph: Any) -> None:
        for i in range(graph.InitializersLength()):
            t = graph.Initializers(i)
            name = _text(t.Name())
            if name in inits:
                raise ValueError(f"{path.name}: initializer {name} twice")
            inits[name] = tensor(t)
        for i in range(graph.NodesLength()):
            n = graph.Nodes(i)
            node = _Node(
                _text(n.Name()),
                _text(n.OpType()),
                [_text(n.Inputs(j)) for j in range(n.InputsLength())],
                [_text(n.Outputs(j)) for j in range(n.OutputsLength())],
            )
            for j in range(n.AttributesLength()):
                a = n.Attributes(j)
                node.attrs[_text(a.Name())] = value(a)
                if a.G() is not None:
                    walk(a.G())
            nodes.append(node)

    walk(model.Graph())
    return inits, nodes


def _one(nodes: list[_Node], what: str) -> _Node:
    distinct = {(n.op, n.name, tuple(n.inputs), tuple(n.outputs)) for n in nodes}
    if len(distinct) != 1:
        raise ValueError(f"{what}: expected one consumer, found {sorted(distinct)}")
    return nodes[0]


def _linear_name(node: str) -> str:
    """HF parameter of the weight a MatMul node named ``node`` multiplies by."""
    parts = node.strip("/").split("/")
    if parts[-1] != "MatMul":
        raise ValueError(f"unexpected MatMul node {node}")
    side = "encoder"
    if parts[:2] == ["model", "decoder"]:
        side, parts = "decoder", parts[2:]
    name = f"model.{side}." + ".".join(_RENAME.get(p, p) for p in parts[:-1]) + ".weight"
    if not _LINEAR.fullmatch(name):
        raise ValueError(f"cannot map MatMul {node} (as {name})")
    return name


def _weights(path: Path, side: str) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """HF parameters from one file, and the small graph constants left over."""
    inits, nodes = read_ort(path)
    mapper = _Mapper(path, inits, nodes)
    for quantized in [k for k in inits if k.endswith("_quantized")]:
        mapper.quantized(quantized.removesuffix("_quantized"))
    mapper.plain(side)
    if side == "encoder":
        mapper.group_norm()
    return mapper.params, mapper.leftovers()


class _Mapper:
    """One ONNX file's initializers mapped to HF parameter names."""

    def __init__(self, path: Path, inits: dict[str, np.ndarray], nodes: list[_Node]) -> None:
        self.path = path
        self.inits = inits
        self.nodes = nodes
        self.users: dict[str, list[_Node]] = defaultdict(list)
        for node in nodes:
            for name in node.inputs:
                self.users[name].append(node)
        self.params: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()

    def put(self, name: str, array: np.ndarray) -> None:
        if name in self.params:
            raise ValueError(f"{self.path.name}: {name} mapped twice")
        self.params[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))

    def quantized(self, base: str) -> None:
        """A weight stored as q * scale + offset, placed by what consumes it."""
        inits, users, name = self.inits, self.users, self.path.name
        scale, offset = inits[base + "_scale"], inits[base + "_zero_point"]
        cast = _one(users[base + "_quantized"], base)
        mul = _one(users[cast.outputs[0]], base)
        add = _one(users[mul.outputs[0]], base)
        if (
            cast.op != "Cast"
            or cast.attrs.get("to") != 1
            or mul.op != "Mul"
            or set(mul.inputs) != {cast.outputs[0], base + "_scale"}
            or add.op != "Add"
            or set(add.inputs) != {mul.outputs[0], base + "_zero_point"}
            or scale.size != 1
            or offset.size != 1
        ):
            raise ValueError(f"{name}: {base} is not dequantized as q * scale + offset")
        weight = inits[base + "_quantized"].astype(np.float32) * float(scale.reshape(())) + float(
            offset.reshape(())
        )
        self.used |= {base + "_quantized", base + "_scale", base + "_zero_point"}
        self._place(base, add.outputs[0], weight)

    def _place(self, base: str, value: str, weight: np.ndarray) -> None:
        """The dequantized weight `value` under the name its consumers give it."""
        name = self.path.name
        consumers = self.users[value]
        ops = {n.op for n in consumers}
        if ops == {"Conv"}:
            conv = re.fullmatch(r"/(conv\d)/Conv", _one(consumers, base).name)
            if conv is None:
                raise ValueError(f"{name}: {base} feeds an unknown conv")
            self.put(f"model.encoder.{conv.group(1)}.weight", weight)
        elif ops == {"MatMul"}:
            names = {_linear_name(n.name) for n in consumers}
            if len(names) != 1 or any(n.inputs.index(value) != 1 for n in consumers):
                raise ValueError(f"{name}: {base} feeds MatMuls {sorted(names)}")
            self.put(names.pop(), weight.T)
        elif ops == {"Gather", "Transpose"}:
            gathers = {n.name for n in consumers if n.op == "Gather"}
            for t in (n for n in consumers if n.op == "Transpose"):
                logits = self.users[t.outputs[0]]
                if not logits or any(n.op != "MatMul" or n.outputs != ["logits"] for n in logits):
                    raise ValueError(f"{name}: the embedding's transpose is not the logits'")
            if gathers != {"/model/decoder/embed_tokens/Gather"}:
                raise ValueError(f"{name}: {base} is gathered by {gathers}")
            self.put("model.decoder.embed_tokens.weight", weight)
        else:
            raise ValueError(f"{name}: {base} feeds {sorted(ops)}")

    def plain(self, side: str) -> None:
        """The float initializers stored as they are (norms, biases, the decoder's merged
        weights)."""
        for name, array in self.inits.items():
            if (
                name in self.used
                or array.dtype != np.float32
                or name.startswith(("/", "onnx::", "present."))
            ):
                continue
            if side == "encoder":
                if not re.fullmatch(r"layers\.\d+\..*|layer_norm\.weight|conv\d\.bias", name):
                    raise ValueError(f"{self.path.name}: unexpected initializer {name}")
                self.put("model.encoder." + name, array)
            else:
                merged = re.fullmatch(r"(model\.decoder\..*)_merged_0", name)
                if merged is None:
                    raise ValueError(f"{self.path.name}: unexpected initializer {name}")
                self.put(".".join(_RENAME.get(p, p) for p in merged.group(1).split(".")), array)
            self.used.add(name)

    def group_norm(self) -> None:
        """The encoder's group norm weight and bias, found by the nodes that use them."""
        for op, which in (("/groupnorm/Mul", "weight"), ("/groupnorm/Add", "bias")):
            node = _one([n for n in self.nodes if n.name == op], op)
            found = [x for x in node.inputs if x in self.inits]
            if len(found) != 1 or self.inits[found[0]].shape != (HIDDEN, 1):
                raise ValueError(f"{self.path.name}: group norm {which} not found")
            self.put(f"model.encoder.groupnorm.{which}", self.inits[found[0]].reshape(HIDDEN))
            self.used.add(found[0])

    def leftovers(self) -> dict[str, np.ndarray]:
        """What no parameter took: small graph constants only (else ValueError)."""
        left = {k: v for k, v in self.inits.items() if k not in self.used}
        for name, array in left.items():
            constant = name.startswith(("/", "onnx::")) and array.size <= 16
            if not constant and not (name.startswith("present.") and array.size == 0):
                raise ValueError(
                    f"{self.path.name}: initializer {name} {array.shape} left unmapped"
                )
        return left


def _check_constants(constants: dict[str, np.ndarray], config: MoonshineConfig) -> None:
    """The graphs' rotary frequencies and attention scale agree with ``config``."""
    dim = int(HEAD_DIM * config.partial_rotary_factor)
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    for key in ("/rotary_emb/Cast_1_output_0", "/model/decoder/rotary_emb/Cast_1_output_0"):
        found = constants[key].reshape(-1)
        if found.shape != inv_freq.shape or np.abs(found - inv_freq).max() > 1e-6:
            raise ValueError(f"rotary frequencies {found} differ from the config's {inv_freq}")
    scale = float(constants["/layers.0/self_attn/Sqrt_1_output_0"].reshape(()))
    if abs(scale * scale - HEAD_DIM**-0.5) > 1e-6:
        raise ValueError(f"attention scale {scale}^2 is not 1/sqrt({HEAD_DIM})")


def load_model(folder: Path, device: str = "cpu") -> MoonshineForConditionalGeneration:
    """The torch model with every parameter filled from the two files (raises otherwise)."""
    enc, enc_left = _weights(folder / "encoder_model.ort", "encoder")
    dec, dec_left = _weights(folder / "decoder_model_merged.ort", "decoder")
    config = MoonshineConfig(**CONFIG)
    _check_constants({**enc_left, **dec_left}, config)
    state = {**enc, **dec, "proj_out.weight": dec["model.decoder.embed_tokens.weight"]}
    # Built for real (not on the meta device): the rotary frequencies are a buffer that no
    # state dict carries.
    model = MoonshineForConditionalGeneration(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if expected != found:
        wrong = sorted(set(expected.items()) ^ set(found.items()))
        raise ValueError(f"Moonshine weights do not fit the model: {wrong[:6]}")
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model.to(device).eval()  # type: ignore[arg-type]


def read_pieces(path: Path) -> list[bytes]:
    data = path.read_bytes()
    pieces, i = [], 0
    while i < len(data):
        n = data[i]
        i += 1
        if n & 0x80:
            n = (n & 0x7F) | (data[i] << 7)
            i += 1
        pieces.append(data[i : i + n])
        i += n
    return pieces


def _loop_end(tokens: list[int]) -> int | None:
    """Where to cut a decoding loop: the tail repeats a span at least twice over, with
    ``MIN_LOOP`` or more tokens past the first copy; the length to keep, or None."""
    n = len(tokens)
    for span in range(1, n // 2 + 1):
        unit = tokens[n - span :]
        copies = 1
        while (
            n - (copies + 1) * span >= 0
            and tokens[n - (copies + 1) * span : n - copies * span] == unit
        ):
            copies += 1
        if copies >= 2 and (copies - 1) * span >= MIN_LOOP:
            return n - (copies - 1) * span
    return None


class Moonshine:
    """Moonshine base-en on ``device``: ``encode`` audio, ``decode`` greedily, ``score`` a
    given transcript. The weights are only read, so engine threads may share one.
    ``precision``: "auto" runs the encoder's linear layers in bfloat16 where the CPU computes
    it natively (``linears.wants_bf16``), "fp32" never."""

    def __init__(
        self, folder: Path | None = None, device: str = "cpu", precision: str = "auto"
    ) -> None:
        self.folder = folder or model_dir()
        self.device = torch.device(device)
        self.model = load_model(self.folder, device)
        if self.device.type == "cpu":
            use_onednn(self.model)
            if wants_bf16(precision, self.device):  # the encoder, as Whisper's
                use_onednn(self.model.model.encoder, bf16=True)
        self.pieces = read_pieces(self.folder / "tokenizer.bin")
        ids: dict[str, int] = {}
        for i, piece in enumerate(self.pieces):
            if i > END and i not in BYTE_IDS:
                ids.setdefault(piece.decode("utf-8", "surrogateescape"), i)
        self._ids = ids

    def encode(self, audio: np.ndarray) -> torch.Tensor:
        """The encoder's states for float32 mono 16 kHz ``audio``."""
        x = torch.as_tensor(np.asarray(audio, dtype=np.float32).reshape(1, -1), device=self.device)
        with torch.inference_mode():
            return self.model.model.encoder(input_values=x).last_hidden_state

    def _logits(
        self, ids: list[int], enc: torch.Tensor, cache: EncoderDecoderCache
    ) -> torch.Tensor:
        inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model.model.decoder(
            input_ids=inputs, encoder_hidden_states=enc, past_key_values=cache, use_cache=True
        )
        return self.model.proj_out(out.last_hidden_state[0]).float()

    def decode(self, enc: torch.Tensor) -> tuple[str, float]:
        """Greedy transcript of ``encode``'s states with the KV cache, and its mean token
        log-probability (the end token included)."""
        found = self.hypothesis(enc)
        return found.text, found.mean

    def hypothesis(self, enc: torch.Tensor, draft: str = "") -> Hypothesis:
        """``decode`` with its token count and the cross-attention keys and values it
        computed from ``enc``, which ``score`` can reuse instead of computing them again.
        ``draft``: text the transcript likely begins with, checked in the first decoder pass
        and kept as far as greedy decoding agrees (``asr.read_draft``): the same transcript
        in fewer passes."""
        seconds = enc.shape[1] * ENCODER_STRIDE / SAMPLE_RATE
        limit = int(seconds * TOKENS_PER_SECOND) + 4
        own = DynamicCache()
        cache = EncoderDecoderCache(own, DynamicCache())
        guess = self.ids(draft)[: limit - 1] if draft.strip() else []
        ids = [START, *guess]
        out: list[int] = []
        logprobs: list[float] = []
        with torch.inference_mode():
            ended = False
            while not ended and len(logprobs) < limit:
                first = not logprobs
                rows = self._logits(ids, enc, cache)
                read = read_draft(rows.log_softmax(-1), guess if first else [])
                if first and guess:
                    # The cache holds every draft token; keep those decoding agreed to.
                    own.crop(len(read))
                for token, logprob in read:
                    logprobs.append(logprob)
                    ended = token == END
                    if ended:
                        break
                    out.append(token)
                    keep = _loop_end(out)
                    ended = keep is not None
                    if ended:
                        del out[keep:], logprobs[keep:]
                        break
                ids = out[-1:]
        total = float(np.sum(logprobs)) if logprobs else float("-inf")
        return Hypothesis(self.text(out), total, len(logprobs), cache.cross_attention_cache)

    def candidates(self, enc: torch.Tensor, beams: int = BEAMS) -> list[str]:
        """The transcripts of ``encode``'s states a beam search of ``beams`` ends, likeliest
        first (asr.beam_search, within ``hypothesis``'s token limit): other readings of the
        same speech for a closer hearing to weigh."""
        seconds = enc.shape[1] * ENCODER_STRIDE / SAMPLE_RATE
        limit = int(seconds * TOKENS_PER_SECOND) + 4
        with torch.inference_mode():
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            first = self._logits([START], enc, cache)[-1].log_softmax(-1)
            cross = cache.cross_attention_cache

            def step(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
                cache.self_attention_cache.reorder_cache(
                    cast(torch.LongTensor, rows.to(self.device))
                )
                cache.cross_attention_cache = widen(cross, len(rows))  # views, no copy
                out = self.model.model.decoder(
                    input_ids=tokens.to(self.device)[:, None],
                    encoder_hidden_states=enc.expand(len(rows), -1, -1),
                    past_key_values=cache,
                    use_cache=True,
                )
                return self.model.proj_out(out.last_hidden_state[:, -1]).float().log_softmax(-1)

            found = beam_search(first, step, END, limit, beams)
        return [text for text in (self.text(t) for t, _ in found) if text]

    def score(self, enc: torch.Tensor, text: str, cross: Cache | None = None) -> tuple[float, int]:
        """Summed log-probability of ``text``'s tokens and the end token given ``encode``'s
        states (one teacher-forced pass), and how many tokens that is. ``cross``:
        ``hypothesis``'s cross-attention cache for the same ``enc`` (only read)."""
        return self.score_many(enc, [text], cross)[0]

    def score_many(
        self, enc: torch.Tensor, texts: list[str], cross: Cache | None = None
    ) -> list[tuple[float, int]]:
        """``score`` for several transcripts of the same encoding in one batched pass (each
        right-padded: the decoder is causal, so padding after a transcript changes none of
        its log-probabilities)."""
        targets = [[*self.ids(text), END] for text in texts]
        width = max(len(t) for t in targets)
        rows = [[START, *t[:-1]] + [END] * (width - len(t)) for t in targets]
        known = (
            widen(cross, len(rows))
            if cross is not None and cross.get_seq_length() > 0
            else DynamicCache()
        )
        with torch.inference_mode():
            cache = EncoderDecoderCache(DynamicCache(), known)
            inputs = torch.tensor(rows, dtype=torch.long, device=self.device)
            out = self.model.model.decoder(
                input_ids=inputs,
                encoder_hidden_states=enc.expand(len(rows), -1, -1),
                past_key_values=cache,
                use_cache=True,
            )
            logprobs = self.model.proj_out(out.last_hidden_state).float().log_softmax(-1)
        return [summed_logprob(logprobs[i], t) for i, t in enumerate(targets)]

    def text(self, ids: list[int]) -> str:
        raw = b"".join(self.pieces[i] for i in ids if i > END and i < len(self.pieces))
        return raw.decode("utf-8", "replace").replace("\u2581", " ").strip()

    def ids(self, text: str) -> list[int]:
        """``text`` as token ids: characters (spaces as "\u2581", one leading) merged pairwise,
        the pair making the lowest piece id first; what no piece covers as byte ids."""
        symbols = list("\u2581" + text.strip().replace(" ", "\u2581"))
        while len(symbols) > 1:
            best, at = None, -1
            for j in range(len(symbols) - 1):
                merged = self._ids.get(symbols[j] + symbols[j + 1])
                if merged is not None and (best is None or merged < best):
                    best, at = merged, j
            if best is None:
                break
            symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
        ids: list[int] = []
        for symbol in symbols:
            piece = self._ids.get(symbol)
            if piece is not None:
                ids.append(piece)
            else:
                ids.extend(BYTE_IDS.start + b for b in symbol.encode("utf-8"))
        return ids
