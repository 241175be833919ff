"""Generated task data: four public task families with checkable short answers.

The families follow the seed study's lookup, filtering, arithmetic totals and sorting.
Each record is a two-message conversation (a user prompt, the assistant's answer) plus
the expected answer text, so a loss can be taken on the assistant's tokens only and a
greedy generation can be checked exactly. Generation is a pure function of a seed
(`random.Random`), so the same arguments always give byte-identical records.
"""

from __future__ import annotations

import random

import blake3
import msgspec

__all__ = [
    "FAMILIES",
    "CONVERSATION",
    "Message",
    "Record",
    "make_record",
    "make_records",
    "make_conversations",
    "record_id",
]

FAMILIES = ("lookup", "filter", "total", "sort")
CONVERSATION = "chat"  # conversation-like records: the replay (and retention) data, not a task family


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat message."""

    role: str
    content: str


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A conversation with its family, split and the answer a generation must reproduce."""

    id: str  # BLAKE3 of the canonical encoding of (family, messages, answer)
    family: str
    split: str
    messages: tuple[Message, ...]
    answer: str

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


_ENC = msgspec.json.Encoder(order="sorted")


def record_id(family: str, messages: tuple[Message, ...], answer: str) -> str:
    """Content id of a record: independent of its split, so exposure can be traced by id."""
    return blake3.blake3(_ENC.encode([family, messages, answer])).hexdigest()


def _numbers(rng: random.Random, n: int, hi: int = 99) -> list[int]:
    return [rng.randint(0, hi) for _ in range(n)]


def _task(family: str, rng: random.Random) -> tuple[str, str]:
    if family == "lookup":
        keys = rng.sample("abcdefgh", rng.randint(3, 4))
        values = _numbers(rng, len(keys))
        k = rng.choice(keys)
        table = " ".join(f"{a}={v}" for a, v in zip(keys, values))
        return f"lookup {k} in {table}", str(values[keys.index(k)])
    if family == "filter":
        xs, t = _numbers(rng, rng.randint(4, 5)), rng.randint(20, 80)
        kept = [x for x in xs if x > t]
        return f"keep >{t}: {' '.join(map(str, xs))}", " ".join(map(str, kept)) or "none"
    if family == "total":
        xs = _numbers(rng, rng.randint(2, 3), hi=50)
        return f"sum {' '.join(map(str, xs))}", str(sum(xs))
    if family == "sort":
        xs = _numbers(rng, rng.randint(3, 5))
        return f"sort {' '.join(map(str, xs))}", " ".join(map(str, sorted(xs)))
    raise ValueError(f"unknown task family {family!r}")


_NAMES = ("ada", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu", "max", "nia", "oz", "pia")
_THINGS = ("the garden", "my code", "the trip", "dinner", "the report", "music", "the weather", "a book")


def _conversation(rng: random.Random) -> tuple[str, str]:
    name, thing, n = rng.choice(_NAMES), rng.choice(_THINGS), rng.randint(2, 30)
    kind = rng.randrange(4)
    if kind == 0:
        return f"hi, I am {name} and I am {n}", f"hello {name}, nice to meet you"
    if kind == 1:
        return f"can you help me with {thing} for {n} minutes?", f"sure, tell me more about {thing}"
    if kind == 2:
        return f"thanks for the help with {thing}, {name} says hi", f"you are welcome, say hi to {name}"
    return f"what do you think of {thing} after {n} days?", f"I like {thing}"


def make_conversations(split: str, count: int, *, seed: int, exclude: set[str] | None = None) -> list[Record]:
    """`count` distinct conversation-like records (family `CONVERSATION`); ids in `exclude` are redrawn."""
    rng = random.Random(f"shardtrain-chat-v1:{seed}:{split}")
    seen = set(exclude or ())
    out: list[Record] = []
    for _ in range(count * 50):
        if len(out) == count:
            break
        prompt, answer = _conversation(rng)
        messages = (Message("user", prompt), Message("assistant", answer))
        r = Record(
            id=record_id(CONVERSATION, messages, answer),
            family=CONVERSATION,
            split=split,
            messages=messages,
            answer=answer,
        )
        if r.id not in seen:
            seen.add(r.id)
            out.append(r)
    if len(out) < count:
        raise ValueError(f"only {len(out)} distinct conversations could be drawn for split {split!r}, not {count}")
    return out


def make_record(family: str, rng: random.Random, split: str) -> Record:
    prompt, answer = _task(family, rng)
    messages = (Message("user", prompt), Message("assistant", answer))
    return Record(id=record_id(family, messages, answer), family=family, split=split, messages=messages, answer=answer)


def make_records(
    split: str, count: int, *, seed: int, exclude: set[str] | None = None, mix: tuple[str, ...] = FAMILIES
) -> list[Record]:
    """`count` records cycling through `mix` (families, repeats weight them); ids in `exclude`
    (and repeats) are redrawn."""
    rng = random.Random(f"shardtrain-tasks-v1:{seed}:{split}")
    seen = set(exclude or ())
    out: list[Record] = []
    while len(out) < count:
        r = make_record(mix[len(out) % len(mix)], rng, split)
        if r.id in seen:
            continue
        seen.add(r.id)
        out.append(r)
    return out
