"""A Hugging Face tokenizer asset set, used through `transformers` itself.

A user's model comes with its tokenizer as files (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json` when present, and a chat template in `chat_template.jinja` or
inside `tokenizer_config.json`). A prepared job binds every one of them by hash
(`shardtrain.job`); this module builds the tokenizer only from those verified bytes: it
writes them to a private temporary directory and loads it with
`transformers.AutoTokenizer.from_pretrained` (local files only, nothing downloaded), so
tokenization, special tokens and chat rendering are the `tokenizers`/`transformers`
implementations and the model's own template, not a re-implementation. Each rendering is
bounded in CPU time and size (`shardtrain.job.rendering`): a template that loops is refused.

Target weights are assistant-only, as for the embedded byte tokenizer: the conversation is
rendered once with the model's chat template (`apply_chat_template`) and tokenized once,
with character offsets; a token is weighted when it starts inside an assistant message's
span, which runs from the end of the rendering of the messages before it with the
generation prompt to the end of the rendering that includes it (the template must be
prefix-stable, else the conversation is refused). The ids are exactly what
`apply_chat_template(messages, tokenize=True)` gives.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from shardtrain.engine.model import LlamaConfig
from shardtrain.errors import JobError
from shardtrain.job.rendering import bounded_render
from shardtrain.job.tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "HF_CONFIG_FILE",
    "HF_TOKENIZER_FILE",
    "CHAT_TEMPLATE_FILE",
    "is_hf_assets",
    "check_hf_assets",
    "HFTokenizer",
    "build_tokenizer",
    "commit_config_dict",
]

HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_MAX_CONFIG_BYTES = 16 << 20


def is_hf_assets(names: Sequence[str]) -> bool:
    """A Hugging Face asset set is recognised by its `tokenizer_config.json`."""
    return HF_CONFIG_FILE in names


def check_hf_assets(assets: Mapping[str, bytes], where: str) -> None:
    """Refuse an asset set without its tokenizer, its config, or a chat template, naming the missing file."""
    for name in (HF_TOKENIZER_FILE, HF_CONFIG_FILE):
        if name not in assets:
            raise JobError(f"{where}: the tokenizer asset {name} is missing")
    if CHAT_TEMPLATE_FILE in assets:
        return
    raw = bytes(assets[HF_CONFIG_FILE])
    if len(raw) > _MAX_CONFIG_BYTES:
        raise JobError(f"{where}: {HF_CONFIG_FILE} is {len(raw)} bytes, over the {_MAX_CONFIG_BYTES}-byte limit")
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise JobError(f"{where}: {HF_CONFIG_FILE} is not readable JSON ({exc})") from None
    if not (
        isinstance(config, dict) and isinstance(config.get("chat_template"), (str, list)) and config["chat_template"]
    ):
        raise JobError(
            f"{where}: no chat template: {CHAT_TEMPLATE_FILE} is missing and {HF_CONFIG_FILE} has no "
            f"chat_template; training on chat records needs the model's own template"
        )


class HFTokenizer:
    """The `transformers` tokenizer of an asset set, with the interface the trainer uses.

    `encode_chat` gives ids and assistant-only weights, `encode_prompt` the ids of a
    prompt with the generation prompt, `decode` text; `bos_id`, `eos_id` and `pad_id` are
    the tokenizer's (pad falls back to eos when the tokenizer names none, with zero weight
    wherever it is used), and `end_id` (a generation's stop token) is eos.
    """

    def __init__(self, assets: Mapping[str, bytes]) -> None:
        check_hf_assets(assets, "tokenizer assets")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - the [hf] extra is missing
            raise JobError("a Hugging Face tokenizer needs transformers: pip install 'shardstore[hf]'") from exc
        with tempfile.TemporaryDirectory(prefix="shardtrain-tokenizer-") as d:
            for name, data in assets.items():
                with open(os.path.join(d, os.path.basename(name)), "wb") as f:
                    f.write(bytes(data))
            try:
                self._tok: Any = AutoTokenizer.from_pretrained(d, local_files_only=True)
            except Exception as exc:  # transformers raises many kinds (OSError, ValueError, KeyError...)
                raise JobError(
                    f"the tokenizer assets do not load with transformers' AutoTokenizer: {type(exc).__name__}: {exc}"
                ) from exc
        if self._tok.eos_token_id is None:
            raise JobError("the tokenizer names no eos token (a generation could never stop)")
        self.vocab_size = len(self._tok)
        self.bos_id: int | None = self._tok.bos_token_id
        self.eos_id: int = self._tok.eos_token_id
        self.pad_id: int = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.end_id: int = self.eos_id

    @property
    def special_ids(self) -> dict[str, int]:
        """bos/eos/pad token ids as a model's config.json names them (only those the tokenizer has)."""
        out = {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "pad_token_id": self._tok.pad_token_id}
        return {k: v for k, v in out.items() if v is not None}

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False) -> str:
        def render() -> str:
            try:
                text = self._tok.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except Exception as exc:  # jinja2 errors and transformers' own
                raise JobError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc
            assert isinstance(text, str)
            return text

        return bounded_render(render, "the chat template")

    def encode(self, text: str) -> list[int]:
        """Ids of already rendered text (special tokens in it become their ids; none are added)."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def encode_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Ids of `messages` followed by the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[float]]:
        """Ids of a whole conversation and, per token, 1.0 if it lies in an assistant message."""
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(start) and full.startswith(upto)):
                raise JobError(
                    f"the chat template is not prefix-stable at message {i}; assistant targets cannot be located"
                )
            spans.append((len(start), len(upto)))
        enc = self._tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        weights = [1.0 if any(a <= s < b for a, b in spans) else 0.0 for s, _ in enc["offset_mapping"]]
        return ids, weights


def build_tokenizer(files: Mapping[str, bytes], names: tuple[str, ...]) -> ByteTokenizer | HFTokenizer:
    """A job's tokenizer from its bound asset files: `transformers` for a Hugging Face set,
    else the embedded byte-level tokenizer."""
    return HFTokenizer({n: files[n] for n in names}) if is_hf_assets(names) else load_tokenizer(files)


def commit_config_dict(config: LlamaConfig, tok: ByteTokenizer | HFTokenizer) -> dict[str, Any]:
    """`config` as a commit binds it (Hugging Face field names); a Hugging Face tokenizer adds
    its bos/eos/pad token ids, so an exported directory's config.json names them."""
    return {**config.to_hf_dict(), **(tok.special_ids if isinstance(tok, HFTokenizer) else {})}
