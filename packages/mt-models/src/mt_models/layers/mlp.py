"""Dense SwiGLU MLP: dense layers (Qwen3-MoE's ``mlp_only_layers``, DeepSeek's first-k-dense)
and shared experts."""

from torch import Tensor, nn

from mt_models.layers.linear import Linear
from mt_ops import swiglu


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Args:
        hidden_size: Model dim D.
        intermediate_size: Hidden dim of the MLP.
        bias: Biases on the three projections (DeepSeek's ``mlp_bias``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the MLP to ``x`` [..., D]."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
