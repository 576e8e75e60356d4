"""Activation offload on a side stream (parallel/offload.py, issue 34): the copies run on the side
stream, the compute stream waits for each copy's event before autograd uses the tensor, and no
copy's source is let go before that event completes. This machine has no device with asynchronous
streams, so the order is proven on a TEST DOUBLE (tests/doubles/stream_log.py) whose streams log
every call; a dispatch mode logs each aten op with the stream current when it ran. The cp runs'
bit-identity with synchronous copies is tests/parallel/test_long_context.py's.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from doubles.stream_log import StreamLogDevice
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _ptrs(tree) -> set[int]:
    return {_ptr(a) for a in tree_leaves(tree) if isinstance(a, torch.Tensor)}


class _Ops(TorchDispatchMode):
    """Logs ``("copy", stream, dst, index)`` for each ``copy_`` and ``("use", stream, inputs, outputs)``
    (storage addresses) for every other op, with the double's current stream; a copy's source logs
    ``("free", index)`` when it dies."""

    def __init__(self, device: StreamLogDevice):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        log, stream = self.device.log, self.device.current_stream().name
        if func is torch.ops.aten.copy_.default:
            log.append(("copy", stream, _ptr(args[0]), len(log)))
            weakref.finalize(args[1], log.append, ("free", len(log) - 1))
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        log.append(("use", stream, _ptrs((args, kwargs)), _ptrs(out)))
        return out


def _model():
    from chipset.kernels import KernelRegistry
    from chipset.models.config import ModelConfig
    from chipset.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64)
    return Transformer(cfg, KernelRegistry("reference"), seed=3)


def _step(model, device: StreamLogDevice) -> tuple[float, dict]:
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 24), generator=g), torch.randint(0, 64, (2, 24), generator=g)
    with _Ops(device):
        loss = model.loss(tokens, targets)
        device.log.append(("backward",))
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs():
    """(log of the offloaded step, log of the plain step, their losses and gradients). After the
    step the device synchronizes (every copy has completed) and the model is dropped, so every
    copy's source has died, and logged it, by the time the log is read."""
    import chipset
    from chipset.parallel.offload import apply_offload

    plain_dev, dev = StreamLogDevice(), StreamLogDevice()
    plain = _step(_model(), plain_dev)
    model = _model()
    apply_offload(list(model.layers), chipset.backend().memory, dev)
    got = _step(model, dev)
    dev.synchronize()
    del model
    gc.collect()
    return dev.log, plain_dev.log, got, plain


def _side_copies(log):
    """(index, stream) of every copy on a side stream, and the event recorded after each."""
    out, waiting = {}, {}
    for i, entry in enumerate(log):
        if entry[0] == "copy" and entry[1] != "compute":
            waiting[entry[1]] = i
        elif entry[0] == "record" and entry[1] in waiting:
            out[waiting.pop(entry[1])] = entry[2]
    return out


def test_offloaded_step_on_a_side_stream_equals_the_plain_step(runs):
    """Copies only: loss and every gradient bit-identical to the step without offload."""
    _, _, (loss, grads), (want_loss, want) = runs
    assert loss == want_loss and all(torch.equal(grads[n], want[n]) for n in want)


def test_offload_copies_run_on_one_side_stream_each_way_once(runs):
    """Every saved tensor goes to the host on the side stream in forward and comes back on it in
    backward, once (prefetched or not); the compute stream copies only what the plain step copies.
    Each side copy comes after the side stream waited for the compute stream (which produced the
    source, or last used the destination's memory)."""
    log, plain_log, _, _ = runs
    side = _side_copies(log)
    backward = log.index(("backward",))
    out, back = [i for i in side if i < backward], [i for i in side if i > backward]
    assert len(out) >= 3 * 4 and len(back) == len(out), (len(out), len(back))  # a few per block
    assert len({log[i][1] for i in side}) == 1
    compute = [e for e in log if e[0] == "copy" and e[1] == "compute"]
    assert len(compute) == sum(1 for e in plain_log if e[0] == "copy")
    last = 0
    for i in sorted(side):
        assert ("wait_stream", log[i][1], "compute") in log[last:i], f"side copy at {i} did not wait for compute"
        last = i


def test_compute_stream_waits_for_each_copy_before_using_its_tensor(runs):
    """An op on the compute stream that reads memory a side-stream copy wrote last runs only after
    the compute stream waited for that copy's event (memory an op wrote since is the op's)."""
    log, _, _, _ = runs
    event = _side_copies(log)
    writer, waited, checked = {}, set(), 0
    for i, entry in enumerate(log):
        if entry[0] == "copy":
            writer[entry[2]] = event.get(i)  # None: the compute stream wrote it
        elif entry[:2] == ("wait_event", "compute"):
            waited.add(entry[2])
        elif entry[:2] == ("use", "compute"):
            for ptr in entry[2] & writer.keys():
                if writer[ptr] is not None:
                    assert writer[ptr] in waited, f"op at {i} reads a copy's tensor before waiting for {writer[ptr]}"
                    checked += 1
            writer.update(dict.fromkeys(entry[3]))
    assert checked >= 3 * 4  # the tensors that came back were used


def test_no_copy_source_is_let_go_before_its_copy_completes(runs):
    """The double's events complete late (at the second query or at synchronize): a source freed
    at its copy's first look is caught. Every source died (the model was dropped)."""
    log, _, _, _ = runs
    done = {e[1]: i for i, e in enumerate(log) if e[0] == "complete"}
    freed = {e[1]: i for i, e in enumerate(log) if e[0] == "free"}
    side = _side_copies(log)
    for i, ev in side.items():
        assert i in freed, f"the source of side copy {i} never died"
        assert ev in done and done[ev] < freed[i], f"the source of side copy {i} died before {ev} completed"
    backward = log.index(("backward",))
    assert any(done[ev] < backward for i, ev in side.items() if i < backward)  # sources let go in forward
