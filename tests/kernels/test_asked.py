"""chipset.kernels.asked: a kernel predicate's one question to the device, asked once, with
gradients on, untraced under torch.compile, and without importing the compiler."""

from __future__ import annotations

import torch

import testenv
from chipset.kernels.asked import CONSTANT_MARK, asked_once


def test_the_mark_is_what_torchs_constant_result_decorator_sets():
    import torch._dynamo

    def question():
        return True

    before = set(vars(question))
    assert torch.compiler.assume_constant_result(question) is question
    assert set(vars(question)) - before == {CONSTANT_MARK}
    assert getattr(question, CONSTANT_MARK) is True


def test_a_compiled_caller_under_no_grad_gets_the_answer_of_one_real_backward():
    asked = []

    @asked_once
    def runs_backward(n: int) -> bool:
        asked.append(n)
        x = torch.ones(3, requires_grad=True)
        (x * n).sum().backward()  # fails under no_grad or inference_mode, and breaks a traced graph
        return bool(x.grad.eq(n).all())

    def layer(x):
        return x * 2 if runs_backward(2) else x - 1

    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # a graph break fails here
    with torch.no_grad():
        outs = [compiled(torch.ones(2)) for _ in range(3)]
    assert all(out.eq(2).all() for out in outs)
    with torch.inference_mode():
        assert runs_backward(2) and runs_backward(3)
    assert asked == [2, 3]  # once per argument
    runs_backward.forget()
    assert runs_backward(2) and asked == [2, 3, 2]


def test_loading_the_backends_kernels_imports_no_compiler():
    code = ("import os\n"
            "os.environ.pop('CHIPSET_DISABLE_PLUGINS', None)\n"
            "import chipset\n"
            "for name in ('cpu', 'cpu_sim'):\n"
            "    chipset.backend(name).device.set_device(0)\n"
            "import chipset_cpu.kernels, chipset_cuda.kernels\n")
    assert testenv.compiler_modules_after(code) == []
