"""Built-in verifiable tasks and JSONL prompt files, in a byte vocabulary (token id = byte).

A task gives the prompts of a step, deterministically from ``(seed, index)``, and scores
completions with its reward. Every task is small enough to learn on a laptop CPU; the
completion format is the answer followed by a newline (token 10, ``rl.stop_ids``' default).

* ``addition``: ``"3+5="`` -> ``"8\\n"``, one-digit operands; reward 1 for the exact sum, 0.1 for
  a number that is wrong, 0 otherwise.
* ``sort``: ``"sort 312:"`` -> ``"123\\n"``, three digits; reward: the fraction of positions right.
* ``target_sum``: ``"sum 7:"`` -> two digits adding up to 7 (``"34\\n"``); reward 1 if they do.
  Its ``answer`` is the target; ``demo`` is one right completion (for :func:`sft_batch`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from chipset.errors import ConfigError

__all__ = ["Prompt", "TASKS", "PromptSource", "encode", "decode", "answer_text", "prompt_source", "sft_batch"]


@dataclass
class Prompt:
    """One prompt: its text, and what its rewards get as keyword arguments (``answer`` and so on)."""

    text: str
    meta: dict = field(default_factory=dict)


def encode(text: str) -> list[int]:
    """Token ids of ``text`` in the byte vocabulary."""
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Text of byte-vocabulary token ids (ids beyond a byte, which a model may sample, become U+FFFD)."""
    return bytes(int(i) if 0 <= int(i) < 256 else 63 for i in ids).decode("utf-8", errors="replace")


def answer_text(completion: str) -> str:
    """The completion up to its first newline (the answer of the built-in tasks)."""
    return completion.split("\n", 1)[0].strip()


def _addition(rng: random.Random) -> Prompt:
    a, b = rng.randrange(10), rng.randrange(10)
    return Prompt(f"{a}+{b}=", {"answer": str(a + b)})


def _sort(rng: random.Random) -> Prompt:
    digits = "".join(str(rng.randrange(10)) for _ in range(3))
    return Prompt(f"sort {digits}:", {"answer": "".join(sorted(digits))})


def _target_sum(rng: random.Random) -> Prompt:
    t = rng.randrange(19)
    a = rng.randrange(max(0, t - 9), min(t, 9) + 1)
    return Prompt(f"sum {t}:", {"answer": str(t), "demo": f"{a}{t - a}"})


def addition_reward(prompts, completions, answer, **_):
    """1 for the exact sum, 0.1 for a wrong number (the format was right), 0 otherwise."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        got = answer_text(c)
        out.append(1.0 if got == a else 0.1 if got.isdigit() else 0.0)
    return out


def sort_reward(prompts, completions, answer, **_):
    """The fraction of the sorted digits in the right place."""
    return [sum(x == y for x, y in zip(answer_text(c), a, strict=False)) / len(a) if len(answer_text(c)) == len(a) else 0.0
            for c, a in zip(completions, answer, strict=True)]


def target_sum_reward(prompts, completions, answer, **_):
    """1 when the completion is two digits that add up to the target."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        got = answer_text(c)
        out.append(1.0 if len(got) == 2 and got.isdigit() and int(got[0]) + int(got[1]) == int(a) else 0.0)
    return out


TASKS = {
    "addition": (_addition, addition_reward),
    "sort": (_sort, sort_reward),
    "target_sum": (_target_sum, target_sum_reward),
}
"""name -> (prompt maker from a seeded random.Random, reward)."""


class PromptSource:
    """The prompts of a run: ``prompt(i)`` is the ``i``-th prompt of the run's stream, the same on
    every rank and after a resume (a task draws it from ``(seed, i)``; a file cycles its lines in
    an order shuffled by ``seed`` once per pass)."""

    def __init__(self, *, task: str = "", path: str = "", seed: int = 0):
        self.seed = seed
        self.task = task
        self.reward = None
        if task:
            if task not in TASKS:
                raise ConfigError(f"rl.task = {task!r}: expected one of {', '.join(TASKS)} (or rl.task = \"\" "
                                  "with rl.prompts = a JSONL file)")
            self._make, self.reward = TASKS[task]
            self.records = None
        else:
            self.records = _read_jsonl(Path(path))

    def prompt(self, i: int) -> Prompt:
        if self.records is None:
            return self._make(random.Random(self.seed * 1_000_003 + i))
        n = len(self.records)
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + i // n).shuffle(order)
        return self.records[order[i % n]]


def _read_jsonl(path: Path) -> list[Prompt]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"rl.prompts = {str(path)!r}: cannot read it ({exc}); expected a JSONL file with one "
                          '{"prompt": ...} object per line') from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc}); expected one object per line") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ConfigError(f'{path}:{n}: expected an object with a "prompt" string, found {line[:80]!r}')
        out.append(Prompt(rec.pop("prompt"), rec))
    if not out:
        raise ConfigError(f"rl.prompts = {str(path)!r}: no prompts in it; expected one JSON object per line")
    keys = {frozenset(p.meta) for p in out}
    if len(keys) > 1:
        raise ConfigError(f"{path}: the lines have different fields ({sorted(sorted(k) for k in keys)}); every "
                          "line needs the same ones, as they reach the rewards as keyword arguments")
    return out


def prompt_source(rl, seed: int) -> PromptSource:
    """The prompt source of an ``[rl]`` section (RLConfig)."""
    return PromptSource(task=rl.task, path=rl.prompts, seed=seed)


def sft_batch(source: PromptSource, step: int, batch: int, seq_len: int) -> tuple:
    """A supervised batch in the task's format, for a warm-up before RL: ``(inputs, targets)``
    of ``batch`` rows ``prompt + completion + "\\n"`` (byte ids, zero-padded to ``seq_len + 1``), the
    targets -100 (ignored) on the prompt and the padding. Prompts ``step * batch ...`` of the
    source; the completion is the prompt's ``demo`` (a right completion, where ``answer`` is not
    one: target_sum's answer is the target) or else its ``answer``."""
    import torch

    x = torch.zeros(batch, seq_len, dtype=torch.long)
    y = torch.full((batch, seq_len), -100, dtype=torch.long)
    for j in range(batch):
        p = source.prompt(step * batch + j)
        demo = p.meta.get("demo", p.meta.get("answer"))
        if demo is None:
            raise ConfigError(f"prompt {p.text!r}: a supervised warm-up needs a \"demo\" or \"answer\" field "
                              f"(the completion to learn), found only {sorted(p.meta)}")
        prompt, full = encode(p.text), encode(p.text + str(demo) + "\n")
        if len(full) > seq_len + 1:
            raise ConfigError(f"prompt {p.text!r} and its answer need {len(full)} tokens; raise seq_len")
        row = torch.tensor(full)
        x[j, :len(full) - 1] = row[:-1]
        y[j, len(prompt) - 1:len(full) - 1] = row[len(prompt):]
    return x, y
