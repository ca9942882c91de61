"""Launching Triton kernels on CUDA, or through Triton's interpreter on CPU tensors.

Kernels are written once with ``@triton.jit``. On a CUDA tensor they compile as usual; on
CPU tensors (tests on a machine without a GPU) :func:`launch` runs the same kernel body
through ``triton.runtime.interpreter``, without the process-wide ``TRITON_INTERPRET``
variable, so CPU tests can exercise kernel logic while the training path on CPU runs
eager PyTorch (see the package docstring). The interpreter is faithful for integer and fp32
arithmetic, loads, stores and fp8 -> fp32 conversion; it mis-rounds casts *to* fp8/bf16,
so tests check those on GPU. Calls from a kernel to other ``@triton.jit`` functions
(``tl.max`` is one) are routed to the interpreter for the duration of the launch only, and
the patch is undone afterwards. So are the interpreter's patches of ``triton.language``
itself: Triton 3.6 leaves those of a device-function call in place, after which kernels
no longer compile for CUDA in the same process.
"""

from functools import cache

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with Linux torch wheels
    triton, tl = None, None
    HAS_TRITON = False
try:  # CUDA's fast-math device functions (the interpreter replaces the one used here)
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover
    libdevice = None
try:  # TMA descriptors (Triton >= 3.4); without them the kernels use pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None
try:  # the interpreter (CPU runs of kernels) also needs numpy, which torch does not require
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    interpreter, InterpretedFunction = None, None

__all__ = [
    "HAS_TRITON", "TensorDescriptor", "cdiv", "launch", "num_sms", "sigmoid", "triton", "tl",
    "use_kernels",
]  # fmt: skip


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


@cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes persistent grids)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAS_TRITON:

    @triton.jit
    def sigmoid(x):
        """``1 / (1 + 2^(-x·log2(e)))`` in fp32: the SwiGLU kernels' sigmoid, one helper so that
        fused and unfused kernels round alike.

        ``tl.sigmoid`` lowers to ``ex2.approx.f32`` and ``div.full.f32``, whose range checks
        cost 38 instructions per element in the fused SwiGLU + quantization forward against
        31 here (sm_90 SASS). This uses the flush-to-zero ``ex2`` (``tl.exp2``) and
        ``div.approx`` (``fast_dividef``). On the H200 it equals ``tl.sigmoid`` bit for bit
        wherever ``1 + 2^(-x·log2(e)) < 2^126``, i.e. for x above -87.3: below that
        ``div.approx`` returns 0 where ``div.full`` returns the denormal ``1 / (1 + e^-x)``.
        The fused forward ([98304, 1408] bf16) ran 281 against 304 us with it.
        """
        return libdevice.fast_dividef(1.0, 1.0 + tl.exp2(x * -1.4426950408889634))

else:  # pragma: no cover
    sigmoid = None


@cache
def _interpreted(fn):
    return InterpretedFunction(fn)


def _patch_tensor_index(original):
    # Triton 3.6's interpreter turns a scalar into int() of a 1-element array, which
    # NumPy >= 2.4 refuses ("only 0-dimensional arrays..."), breaking `range(n)` loops.
    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    return patched


_MISSING = object()


def _run_interpreted(kernel, grid, args, kwargs) -> None:
    jit_cls = type(kernel)
    saved_call = jit_cls.__call__
    saved_patch = interpreter._patch_lang_tensor
    scope_cls = interpreter._LangPatchScope
    saved_set_attr = scope_cls.set_attr
    # Every attribute the interpreter patches, with the object's own value before the launch
    # (_MISSING where it was inherited or absent). A launch restores its own patches, but a
    # device-function call (InterpretedFunction.__call__) patches triton.language again and
    # never restores: tl.core stays patched and the next CUDA compile fails ("'ir.value'
    # object has no attribute 'dtype'").
    originals = {}

    def set_attr(scope, obj, name, value):
        originals.setdefault((id(obj), name), (obj, name, vars(obj).get(name, _MISSING)))
        saved_set_attr(scope, obj, name, value)

    # Device-function calls inside the interpreted kernel go through JITFunction.__call__,
    # which refuses outside a compiled kernel; route them to the interpreter meanwhile.
    jit_cls.__call__ = lambda self, *a, **k: _interpreted(self.fn)(*a, **k)
    interpreter._patch_lang_tensor = _patch_tensor_index(saved_patch)
    scope_cls.set_attr = set_attr
    # The interpreter runs no extern (libdevice) calls: the fast division is a division.
    saved_dividef = libdevice.fast_dividef
    libdevice.fast_dividef = lambda x, y: x / y
    try:
        _interpreted(kernel.fn)[grid](*args, **kwargs)
    finally:
        libdevice.fast_dividef = saved_dividef
        jit_cls.__call__ = saved_call
        interpreter._patch_lang_tensor = saved_patch
        scope_cls.set_attr = saved_set_attr
        for obj, name, value in originals.values():
            if value is not _MISSING:
                setattr(obj, name, value)
            elif name in vars(obj):
                delattr(obj, name)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Runs ``kernel[grid](*args, **kwargs)``, through the interpreter for CPU tensors.

    Args:
        kernel: A ``@triton.jit`` function.
        grid: Launch grid; an empty grid (a zero in it) launches nothing.
        *args: Kernel arguments (tensors on one device, ints, floats).
        **kwargs: Keyword arguments (constexprs, ``num_warps``, ``num_stages``,
            ``launch_cooperative_grid``; the interpreter drops the last three).
    """
    if any(g == 0 for g in grid):
        return
    on_cpu = any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args)
    if on_cpu:
        launch_options = ("num_warps", "num_stages", "launch_cooperative_grid")
        kwargs = {k: v for k, v in kwargs.items() if k not in launch_options}
        _run_interpreted(kernel, grid, args, kwargs)
    else:
        kernel[grid](*args, **kwargs)


def use_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the training path should launch Triton kernels for these tensors (CUDA)."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)
