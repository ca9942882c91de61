import torch
import triton.language as tl
from triton.language.extra.cuda import libdevice

from mt_ops.rms_norm import _kernel_function_for_test
from mt_ops.swiglu import _swiglu_fwd


def _members() -> dict[tuple[str, str], int]:
    objects = {"tl": tl, "tl.core": tl.core, "tl.math": tl.math, "tl.tensor": tl.tensor}
    objects["tl.dtype"] = tl.dtype
    objects["libdevice"] = libdevice  # its fast division, replaced during interpreted launches
    return {
        (key, name): id(value) for key, obj in objects.items() for name, value in vars(obj).items()
    }


def test_interpreted_launch_leaves_triton_language_as_it_found_it():
    # The RMSNorm kernels call device functions (tl.sum, tl.cdiv), which Triton 3.6's
    # interpreter patches triton.language for without undoing; CUDA compiles in the same
    # process (a GPU test after CPU ones) would then fail.
    before = _members()
    x, w = torch.randn(5, 77, requires_grad=True), torch.ones(77, requires_grad=True)
    _kernel_function_for_test()(x, w).sum().backward()
    gate = torch.randn(1000)
    out = _swiglu_fwd(gate, torch.ones(1000))  # mt_ops._triton.sigmoid's fast division
    torch.testing.assert_close(out, gate * torch.sigmoid(gate))
    after = _members()
    # inspect.getmembers (the interpreter lists tl.tensor's members) gives a class without
    # annotations an empty __annotations__: a side effect of reading, harmless.
    changed = sorted(
        key
        for key in before.keys() | after.keys()
        if before.get(key) != after.get(key) and key[1] != "__annotations__"
    )
    assert not changed, changed[:10]
