"""megatron-core imported with torch's pickle allowlist kept (`import_megatron`), and the CUDA stand-ins that let it run
on the CPU under the test switch (`cpu_stand_ins`)."""
from __future__ import annotations

import contextlib

import torch

from train.engines.cpu_shims import cuda_as_cpu


@contextlib.contextmanager
def keep_pickle_allowlist():
    """torch.serialization's safe globals as they were before the block (megatron-core adds its own at import)."""
    before = list(torch.serialization.get_safe_globals())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def import_megatron() -> None:
    """Import every megatron-core module this engine uses, the allowlist kept as it was."""
    import warnings

    with keep_pickle_allowlist(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" (the CPU): said once below
        import megatron.core  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.optimizer.clip_grads  # noqa: F401
        import megatron.core.optimizer_param_scheduler  # noqa: F401
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.transformer_config  # noqa: F401
        from megatron.core.transformer.module import Float16Module  # noqa: F401
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without Transformer Engine: its router's fallback GEMM
        moe_utils.te_general_gemm = None  # (the name is otherwise undefined there: a NameError in every MoE forward)


def cpu_stand_ins() -> None:
    """megatron-core on the CPU (tests on gloo; DESIGN.md's recipe, as tests/megatron_oracle.py applies it): the
    current device is the CPU, synchronize does nothing, the CUDA RNG tracker's fork is a null context, tensors report
    `torch.cuda.*` types (the distributed optimizer and its clipping refuse others), `.cuda()` is the identity,
    `device="cuda"` factory calls land on the CPU and streams are synchronous stand-ins. No arithmetic changes.
    Process-wide: only under CPU_SWITCH."""
    from megatron.core import tensor_parallel

    if getattr(torch, "_shardkit_mcore_cpu", False):
        return
    torch._shardkit_mcore_cpu = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # the alltoall token dispatcher's side stream for its device-to-host copies: on the CPU every copy is done when
    # it returns, so a stream and its events only need to exist
    torch.cuda.Stream = _HostStream
    main_stream = _HostStream()
    torch.cuda.current_stream = lambda *a, **k: main_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # ...and its split sizes, which it moves to the host as numpy arrays (what all_to_all_single takes): on the CPU
    # they are host tensors already, which megatron-core leaves as they are
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    cuda_as_cpu()


class _HostEvent:
    """An event of _HostStream: always complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream stand-in on the CPU (cpu_stand_ins): work is synchronous, so waiting and recording are no-ops."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass
