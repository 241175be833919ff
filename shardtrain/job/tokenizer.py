"""A tiny byte-level tokenizer with a chat template, built from asset files.

Token ids 0..255 are the bytes of UTF-8 text; ids from 256 up are special tokens, named
in `tokenizer.json` in id order. `chat_template.jinja` renders a conversation the way
Hugging Face chat templates do (`messages`, `add_generation_prompt`, `bos_token`), in
Jinja's sandbox. Both files are *assets*: a prepared job binds each by hash (`job.py`),
so a tokenizer is only ever built from bytes whose hash the job names.

Target weights are assistant-only: a conversation's weighted tokens are exactly what the
model must produce after the generation prompt (the assistant's content and its end
token). They are found by rendering prefixes of the conversation, which requires the
template to be prefix-stable (rendering k+1 messages extends rendering k); a template that
is not is refused rather than guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import jinja2.sandbox
import msgspec

from shardtrain.errors import JobError
from shardtrain.job.rendering import bounded_render

__all__ = ["TOKENIZER_FILE", "TEMPLATE_FILE", "ByteTokenizer", "default_assets", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
_MAX_ASSET_BYTES = 1 << 20

_DEFAULT_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`tokenizer.json`: byte-level base vocabulary plus named special tokens."""

    type: str
    version: int
    specials: tuple[str, ...]
    bos: str
    eos: str
    pad: str
    end: str


_ENC = msgspec.json.Encoder(order="sorted")
_DEC = msgspec.json.Decoder(_Spec)


def default_assets() -> dict[str, bytes]:
    """The embedded tokenizer's asset files, by file name."""
    spec = _Spec(
        type="byte-level",
        version=1,
        specials=_DEFAULT_SPECIALS,
        bos="<|bos|>",
        eos="<|eos|>",
        pad="<|pad|>",
        end="<|end|>",
    )
    return {TOKENIZER_FILE: _ENC.encode(spec), TEMPLATE_FILE: _DEFAULT_TEMPLATE.encode()}


class ByteTokenizer:
    """Bytes plus special tokens; `encode_chat` gives token ids and assistant-only weights."""

    def __init__(self, spec: _Spec, template: str) -> None:
        if spec.type != "byte-level" or spec.version != 1:
            raise JobError(f"{TOKENIZER_FILE}: unsupported tokenizer type {spec.type!r} version {spec.version}")
        if len(set(spec.specials)) != len(spec.specials) or not spec.specials:
            raise JobError(f"{TOKENIZER_FILE}: special tokens must be unique and non-empty")
        for role in ("bos", "eos", "pad", "end"):
            if getattr(spec, role) not in spec.specials:
                raise JobError(f"{TOKENIZER_FILE}: {role} token {getattr(spec, role)!r} is not a special token")
        self.specials = {s: 256 + i for i, s in enumerate(spec.specials)}
        self.vocab_size = 256 + len(spec.specials)
        self.bos_token, self.end_token = spec.bos, spec.end
        self.bos_id, self.eos_id = self.specials[spec.bos], self.specials[spec.eos]
        self.pad_id, self.end_id = self.specials[spec.pad], self.specials[spec.end]
        # Longest first, so a special token that prefixes another cannot shadow it.
        self._split = re.compile(
            "(" + "|".join(re.escape(s) for s in sorted(spec.specials, key=len, reverse=True)) + ")"
        )
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise JobError(f"{TEMPLATE_FILE}: not a valid template: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Special-token strings become their ids; everything else its UTF-8 bytes."""
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self.specials[piece])
            else:
                out.extend(piece.encode("utf-8"))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of `encode` (invalid UTF-8 is replaced, not raised)."""
        names = {v: k for k, v in self.specials.items()}
        out, run = [], bytearray()
        for t in ids:
            if t < 256:
                run.append(t)
                continue
            out.append(run.decode("utf-8", "replace"))
            run = bytearray()
            out.append(names.get(t, "<|?|>"))
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False) -> str:
        def render() -> str:
            try:
                return self._template.render(
                    messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self.bos_token
                )
            except jinja2.TemplateError as exc:
                raise JobError(f"{TEMPLATE_FILE}: rendering failed: {exc}") from exc

        return bounded_render(render, TEMPLATE_FILE)

    def encode_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[float]]:
        """Token ids of a conversation and, per token, 1.0 if the model must produce it.

        A token is weighted when it lies in an assistant message after the generation
        prompt: the assistant's content and the template's end-of-message text.
        """
        ids: list[int] = []
        weights: list[float] = []
        done = ""
        for i, m in enumerate(messages):
            before = self.render(messages[:i], add_generation_prompt=m["role"] == "assistant")
            after = self.render(messages[: i + 1])
            if not before.startswith(done) or not after.startswith(before):
                raise JobError(
                    f"{TEMPLATE_FILE} is not prefix-stable at message {i}; assistant targets cannot be located"
                )
            for text, w in (
                (before[len(done) :], 0.0),
                (after[len(before) :], 1.0 if m["role"] == "assistant" else 0.0),
            ):
                piece = self.encode(text)
                ids.extend(piece)
                weights.extend([w] * len(piece))
            done = after
        return ids, weights


def load_tokenizer(assets: Mapping[str, bytes]) -> ByteTokenizer:
    """Build the tokenizer from its asset files (already hash-checked by the caller)."""
    for name in (TOKENIZER_FILE, TEMPLATE_FILE):
        if name not in assets:
            raise JobError(f"tokenizer asset {name} is missing")
        if len(assets[name]) > _MAX_ASSET_BYTES:
            raise JobError(
                f"tokenizer asset {name} is {len(assets[name])} bytes, over the {_MAX_ASSET_BYTES}-byte limit"
            )
    try:
        spec = _DEC.decode(assets[TOKENIZER_FILE])
    except msgspec.DecodeError as exc:
        raise JobError(f"tokenizer asset {TOKENIZER_FILE} is malformed: {exc}") from exc
    try:
        template = bytes(assets[TEMPLATE_FILE]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobError(f"tokenizer asset {TEMPLATE_FILE} is not UTF-8: {exc}") from exc
    return ByteTokenizer(spec, template)
