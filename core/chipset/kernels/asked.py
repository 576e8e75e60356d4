"""Questions a kernel predicate asks the device once, such as "does this torch build run this op
here, forward and backward?".

Such a question is real work (a tiny call and its backward), so three things can go wrong when
the first layer to need the answer asks it:

- it runs under ``no_grad`` or ``inference_mode`` (an evaluation before training, generation):
  the backward cannot run, and a cached "no" would keep the kernel off for the whole process;
- it is being compiled: ``torch.compile`` would trace the question instead of running it, and
  break the graph on its backward;
- it is asked again on every call, on the hot path.

:func:`asked_once` handles all three: the answer is cached per argument tuple, the question runs
with gradients on, and the compiler runs it untraced and keeps its answer as a constant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["asked_once"]

# The mark torch.compile reads for a function whose result it may treat as a constant: what
# torch.compiler.assume_constant_result sets. It is set here directly because calling that
# function imports torch._dynamo (about 100 MiB of resident memory and a second or more of CPU
# in every process, compiling or not). tests/kernels/test_asked.py checks both that torch's
# decorator still sets exactly this and that a compiled caller gets the answer without a break.
CONSTANT_MARK = "_dynamo_marked_constant"


def asked_once(question: Callable[..., bool]) -> Callable[..., bool]:
    """``question`` asked at most once per argument tuple (the arguments must be hashable), with
    gradients on whatever mode the caller is in, and untraced under ``torch.compile``.
    ``.forget()`` drops the answers (a test's fresh process)."""
    answers: dict[tuple, bool] = {}

    @functools.wraps(question)
    def ask(*args) -> bool:
        answer = answers.get(args)
        if answer is None:
            with torch.inference_mode(False), torch.enable_grad():
                answer = answers[args] = bool(question(*args))
        return answer

    setattr(ask, CONSTANT_MARK, True)
    ask.forget = answers.clear
    return ask
