"""PoolingParams: what an embedding request asks of its pooled vector (vLLM's name and fields).

An embedding request reads the prompt once (prefill only, no token is generated) and pools
the final hidden states into one vector, the way the model's sentence-transformers config
says (model/pooling_config.py).  The request may only narrow that: `dimensions` keeps the
first N components of a matryoshka model's vector (renormalised when the model normalises),
`normalize` overrides the model's own choice.  `validate` raises a `SamplingParamError`
naming the field, so the server answers 400 with `param` set.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.sampling_params import SamplingParamError


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None  # keep the first N components (matryoshka models only)
    normalize: bool | None = None  # None: as the model's config says (a Normalize module or not)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise SamplingParamError("dimensions", f"must be an integer >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise SamplingParamError("normalize", f"must be true, false or null, got {self.normalize!r}")

    @property
    def n(self) -> int:
        """One vector per prompt (what request accounting counts, like `SamplingParams.n`)."""
        return 1
