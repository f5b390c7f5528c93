"""Weight-only quantization schemes as arithmetic: bits per weight and the scales' bytes.

Torch-free (specs/model_spec.py reads it), so the estimator and the simulator count a quantized
model's bytes the same way the engine stores them (model/weights/quantization.py does the quantizing):

* `int8`: one int8 per weight, one float32 scale per output row.
* `int4`: 4 bits per weight, one bfloat16 scale per group of 32 along K (K padded to whole
  groups): 4.5 bits per weight.  `int4-g128`: groups of 128, 4.125 bits.
* int8 with a group (GGUF's Q8_0, read from the file, never a `--quantization` choice): one
  int8 per weight and one 16-bit scale per group of 32 along K, 8.5 bits per weight.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantScheme:
    """One quantization choice: `bits` per weight, `group` along K (0: the whole row), and the
    bytes each group carries besides its integers (`group_bytes`: a 16-bit scale; GGUF's Q4_K
    as we hold it, a float32 scale and a float32 offset)."""

    name: str
    bits: int
    group: int
    group_bytes: int = 2

    def matrix_bytes(self, n: int, k: int) -> int:
        """Bytes of an [n, k] weight matrix, scales included."""
        if self.bits == 8 and not self.group:
            return n * k + 4 * n
        groups = -(-k // self.group)
        return n * groups * (self.group * self.bits // 8 + self.group_bytes)

    def bytes_per_weight(self, k: int) -> float:
        """Storage per weight of a row of `k` inputs, scales included."""
        return self.matrix_bytes(1, k) / k


SCHEMES = {
    "int8": QuantScheme("int8", 8, 0),
    "int4": QuantScheme("int4", 4, 32),
    "int4-g128": QuantScheme("int4-g128", 4, 128),
}


def parse_scheme(name: str) -> QuantScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"--quantization must be one of {', '.join(SCHEMES)}; got {name!r}") from None
