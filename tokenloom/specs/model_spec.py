"""Model arithmetic: parameters, weight bytes, KV bytes per token, FLOPs per token.

The seed's decode step "feeds one token, which attends to the whole KV history".  What
that costs is pure arithmetic on the Hugging Face config:

* every decode step must read every weight once (the weights do not fit in any cache),
* each cached token holds K and V for every layer: 2 * layers * kv_heads * head_dim * bytes,
* each new token does ~2 FLOPs per matmul weight (one multiply, one add) plus attention
  over its context.

FLOP convention (stated once, used everywhere): a matmul of [m, k] x [k, n] is 2*m*k*n
FLOPs; norms, activations, RoPE and softmax are ignored (O(hidden) per token, < 1%).
Attention for one token at context c (the number of positions it attends, itself
included) is 4 * layers * heads * head_dim * c: 2*d*c for Q.K^T and 2*d*c for P.V, per
query head (GQA shares K/V across heads, it does not share the FLOPs).

Mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE): a token's FLOPs count its k active
experts (and the router, and a shared expert), never all E; a step reads each expert
its tokens chose once, so its bytes count the experts it touches -- k per sparse layer
at one token, and for a step of T tokens the expected union under uniform, independent
routing, E * (1 - (1 - k/E)^T) (`experts_touched`): a model, not a measurement --
real routers are skewed, which touches fewer.  The checkpoint's size counts every expert.

Pure Python on purpose: the simulator's clock calls into this thousands of times.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenloom.config import DTYPE_BYTES, ModelShape

_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}

# Rough count of eager PyTorch ops our decoder dispatches, used only to turn the measured
# per-op dispatch cost into a per-step overhead for `local`.  Per layer: two RMSNorms
# (~6 ops each), q/k/v/o projections (4), RoPE on q and k (~8), KV-cache write (2),
# attention (~3), two residual adds (2), gate/up/down (3) and SiLU*mul (2).
OPS_PER_LAYER = 30
OPS_PER_QK_NORM = 12  # Qwen3: two more RMSNorms per layer
OPS_FIXED = 10  # embedding, final norm, lm_head, sampling

_GEMMA = ("gemma2", "gemma3_text")


def normalize_dtype(dtype: str) -> str:
    """'fp16' -> 'float16' etc.; ValueError for anything the estimator does not model."""
    d = _DTYPE_ALIASES.get(dtype, dtype)
    if d not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return d


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 /
    Gemma 3 / Phi-3, and the mixture-of-experts Mixtral / Qwen3-MoE / Qwen2-MoE:
    `num_moe_layers` of its layers route each token to `num_experts_per_tok` of `num_experts`
    experts)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    sandwich_norm: bool = False  # Gemma: four RMSNorms per layer, not two
    torch_dtype: str | None = None  # the dtype the checkpoint ships in, if known
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    num_moe_layers: int = 0  # sparse layers; the others have a dense MLP `intermediate_size` wide

    # ------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: dict, name: str = "model") -> "ModelSpec":
        model_type = str(config.get("model_type", "llama"))
        moe = {}
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if config.get(key) and model_type not in _MOE_FAMILIES:
                raise ValueError(f"{name}: mixture-of-experts configs ({key}) of model_type {model_type!r} are not "
                                 f"modelled; the MoE families modelled: {', '.join(sorted(_MOE_FAMILIES))}")
        if model_type in _MOE_FAMILIES:
            moe = _moe_shape(config, _MOE_FAMILIES[model_type])
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            qwen2 = model_type == "qwen2" or (model_type == "qwen2_moe" and config.get("qkv_bias", True))
            return cls(
                name=name,
                hidden_size=hidden,
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                # Gemma's config classes default head_dim to 256, not hidden // heads
                head_dim=int(config.get("head_dim") or (256 if model_type in _GEMMA else hidden // heads)),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 hard-codes bias on q/k/v (not o), Qwen2-MoE as its qkv_bias says;
                # Llama/Qwen3/Qwen3-MoE have one switch for all four.
                qkv_bias=bool(qwen2) or bool(config.get("attention_bias", False)),
                o_bias=model_type not in ("qwen2", "qwen2_moe") and bool(config.get("attention_bias", False)),
                qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
                sandwich_norm=model_type in _GEMMA,
                mlp_bias=bool(config.get("mlp_bias", False)),
                torch_dtype=config.get("torch_dtype") or config.get("dtype"),
                **moe,
            )
        except KeyError as e:
            raise ValueError(f"{name}: config lacks {e.args[0]!r}") from None

    # ------------------------------------------------------------ parameter counts
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v, o projections (GQA: k and v are kv_dim wide), biases, q/k norms."""
        h = self.hidden_size
        p = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            p += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            p += h
        if self.qk_norm:
            p += 2 * self.head_dim  # RMSNorm over head_dim, shared across heads
        return p

    @property
    def mlp_params_per_layer(self) -> int:
        """gate, up, down projections (SwiGLU)."""
        p = 3 * self.hidden_size * self.intermediate_size
        if self.mlp_bias:
            p += 2 * self.intermediate_size + self.hidden_size
        return p

    @property
    def norm_params_per_layer(self) -> int:
        # input and post-attention RMSNorm (Gemma: and the two around the MLP)
        return (4 if self.sandwich_norm else 2) * self.hidden_size

    @property
    def layer_params(self) -> int:
        """A dense layer's parameters (attention, MLP, norms)."""
        return self.attention_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    # ------------------------------------------------------------ mixture of experts
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.num_moe_layers > 0

    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up, down (SwiGLU, no bias)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def moe_block_params(self) -> int:
        """A sparse layer's MLP: every expert, the router, a shared expert and its 1-wide gate."""
        h = self.hidden_size
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return self.num_experts * (self.expert_params + h) + shared

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all, less the experts it was not routed to."""
        unused = self.num_experts - self.num_experts_per_tok
        return self.total_params - self.num_moe_layers * unused * self.expert_params

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every sparse layer (what a step reads only in part)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts a sparse layer runs in a step of `tokens` tokens, under
        uniform, independent routing: E * (1 - (1 - k/E)^tokens) -- k at one token, E in the
        limit (0 for a dense model)."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    @property
    def lm_head_params(self) -> int:
        """Separate lm_head weights; 0 when tied (the head reuses the embedding matrix)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        dense_layers = self.num_layers - self.num_moe_layers
        layers = (self.num_layers * (self.attention_params_per_layer + self.norm_params_per_layer)
                  + dense_layers * self.mlp_params_per_layer + self.num_moe_layers * self.moe_block_params)
        return self.embedding_params + layers + self.hidden_size + self.lm_head_params

    # ------------------------------------------------------------ matmul weights (what costs FLOPs)
    @property
    def layer_matmul_params(self) -> int:
        """Weights of all decoder-layer linears a token multiplies by (no biases/norms): 2
        FLOPs each per token.  A sparse layer counts its router, a shared expert and gate,
        and k experts, not E."""
        h = self.hidden_size
        attention = 2 * h * self.q_dim + 2 * h * self.kv_dim
        dense_layers = self.num_layers - self.num_moe_layers
        active_moe = 0
        if self.is_moe:
            shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
            active_moe = self.num_experts_per_tok * self.expert_params + self.num_experts * h + shared
        return (self.num_layers * attention + dense_layers * 3 * h * self.intermediate_size
                + self.num_moe_layers * active_moe)

    @property
    def logits_matmul_params(self) -> int:
        """The vocab projection (lm_head, or the tied embedding matrix used as one)."""
        return self.vocab_size * self.hidden_size

    @property
    def matmul_params(self) -> int:
        return self.layer_matmul_params + self.logits_matmul_params

    @property
    def expert_shapes(self) -> list[tuple[int, int]]:
        """(n, k) of one routed expert's matmul weights as the engine stores them: fused gate/up, down."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return [(2 * i, h), (h, i)] if self.is_moe else []

    @property
    def matmul_shapes(self) -> list[tuple[int, int]]:
        """(n, k) of every matmul weight the engine stores packed or quantized: per layer the
        fused q/k/v and o projections, a dense layer's fused gate/up and down, a sparse layer's
        every expert's and its shared expert's; then the vocab projection.  (A router stays in
        the model's dtype: model/moe.py.)"""
        return self._static_shapes() + self.expert_shapes * (self.num_experts * self.num_moe_layers)

    @property
    def static_layer_matmul_params(self) -> int:
        """The decoder layers' stored matmul weights every step reads whole: all of them in a
        dense model; attention, dense MLPs and shared experts in a sparse one (not its routed
        experts, not its routers, which stay in the dtype)."""
        return sum(n * k for n, k in self._static_shapes()) - self.vocab_size * self.hidden_size

    def _static_shapes(self) -> list[tuple[int, int]]:
        """`matmul_shapes` less the routed experts: what every step reads whole."""
        h, i, s = self.hidden_size, self.intermediate_size, self.shared_expert_intermediate_size
        shapes = [(self.q_dim + 2 * self.kv_dim, h), (h, self.q_dim)] * self.num_layers
        shapes += [(2 * i, h), (h, i)] * (self.num_layers - self.num_moe_layers)
        if self.is_moe and s:
            shapes += [(2 * s, h), (h, s)] * self.num_moe_layers
        return shapes + [(self.vocab_size, h)]

    def quantized_matmul_bytes(self, quantization: str) -> int:
        """Bytes of every matmul weight under a weight-only scheme (model/weights/quant_schemes.py), scales included."""
        from tokenloom.model.weights.quant_schemes import parse_scheme

        scheme = parse_scheme(quantization)
        return sum(scheme.matrix_bytes(n, k) for n, k in self.matmul_shapes)

    # ------------------------------------------------------------ bytes
    def weight_bytes(self, dtype: str, quantization: str | None = None) -> int:
        """Size of the whole checkpoint in `dtype` (what must fit in memory); with `quantization`,
        every matmul weight (the tied or untied vocab projection included) in that scheme and
        the rest (norms, biases, routers, an untied input embedding) in `dtype`."""
        nbytes = DTYPE_BYTES[normalize_dtype(dtype)]
        if quantization is None:
            return self.total_params * nbytes
        stored = sum(n * k for n, k in self.matmul_shapes)
        return (self.total_params - stored) * nbytes + self.quantized_matmul_bytes(quantization)

    @property
    def streamed_params(self) -> int:
        """Parameters a one-token step must read from memory.

        All layers, the final norm and the vocab projection.  An *untied* input embedding
        is only gathered (one row per token), so it is not streamed; a tied one is read in
        full as the lm_head.  A sparse layer's experts count k of E (`experts_touched`).
        """
        return self.active_params - (self.embedding_params if not self.tie_word_embeddings else 0)

    def streamed_weight_bytes(self, dtype: str, quantization: str | None = None, tokens: int = 1) -> int:
        """Bytes a step of `tokens` new tokens reads; with `quantization`, the matmul weights in
        that scheme.  The same for any `tokens` in a dense model; in a sparse one the routed
        experts count as many as `experts_touched(tokens)` expects."""
        nbytes = DTYPE_BYTES[normalize_dtype(dtype)]
        all_streamed = self.total_params - (self.embedding_params if not self.tie_word_embeddings else 0)
        static = all_streamed - self.routed_expert_params
        if quantization is None:
            static_bytes, expert_bytes = static * nbytes, self.expert_params * nbytes
        else:
            from tokenloom.model.weights.quant_schemes import parse_scheme

            scheme = parse_scheme(quantization)
            shapes = self._static_shapes()
            static_bytes = ((static - sum(n * k for n, k in shapes)) * nbytes
                            + sum(scheme.matrix_bytes(n, k) for n, k in shapes))
            expert_bytes = sum(scheme.matrix_bytes(n, k) for n, k in self.expert_shapes)
        if not self.is_moe:
            return static_bytes
        return static_bytes + round(self.num_moe_layers * self.experts_touched(tokens) * expert_bytes)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V, every layer: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[normalize_dtype(dtype)]

    # ------------------------------------------------------------ FLOPs
    @property
    def attention_flops_per_position(self) -> int:
        """FLOPs one query token spends per attended position: 4 * layers * heads * head_dim."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def flops_per_token(self, context_len: int, with_logits: bool = True) -> int:
        """FLOPs for one token attending `context_len` positions (itself included).

        2 * matmul params + 4 * layers * heads * head_dim * context_len; `with_logits=False`
        drops the vocab projection (prefill tokens other than a prompt's last need no logits).
        """
        mm = self.matmul_params if with_logits else self.layer_matmul_params
        return 2 * mm + self.attention_flops_per_position * context_len

    def prefill_flops(self, num_tokens: int, context_start: int = 0) -> int:
        """FLOPs to prefill `num_tokens` new tokens after `context_start` cached ones.

        Causal attention: token j (1-based) attends context_start + j positions, so the
        attention term sums to P*c0 + P(P+1)/2.  Only the last token computes logits.
        """
        p = num_tokens
        attn_positions = p * context_start + p * (p + 1) // 2
        return 2 * p * self.layer_matmul_params + 2 * self.logits_matmul_params + self.attention_flops_per_position * attn_positions

    # ------------------------------------------------------------ overhead
    @property
    def eager_ops_per_step(self) -> int:
        """Approximate count of eager ops one forward dispatches (see OPS_PER_LAYER)."""
        per_layer = OPS_PER_LAYER + (OPS_PER_QK_NORM if self.qk_norm else 0)
        return self.num_layers * per_layer + OPS_FIXED

    def default_dtype(self) -> str:
        """The checkpoint's dtype when it is one we model, else float16."""
        try:
            return normalize_dtype(self.torch_dtype) if self.torch_dtype else "float16"
        except ValueError:
            return "float16"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            total_params=self.total_params,
            active_params=self.active_params,
            embedding_params=self.embedding_params,
            layer_params=self.layer_params,
            lm_head_params=self.lm_head_params,
            matmul_params=self.matmul_params,
            streamed_params=self.streamed_params,
        )
        return d


# model_type -> the architecture whose config reading (model/hf_config.py) gives its MoE shape
_MOE_FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}


def _moe_shape(config: dict, architecture: str) -> dict:
    """ModelSpec's expert fields of a config.json, read with transformers' meaning, the
    engine's own reading (`hf_config.moe_fields`: each family's defaults and layer rules)."""
    from tokenloom.model.hf_config import moe_fields

    f = moe_fields(config, architecture, int(config.get("num_hidden_layers", 0)))
    return dict(num_experts=f["num_experts"], num_experts_per_tok=f["num_experts_per_tok"],
                moe_intermediate_size=f["moe_intermediate_size"],
                shared_expert_intermediate_size=f["shared_expert_intermediate_size"],
                num_moe_layers=len(f["moe_layers"]))


def load_config(model: str) -> tuple[dict, str]:
    """(config dict, display name) from a preset name, a model directory or a config.json path."""
    from tokenloom.model.tools.presets import PRESETS, get_preset
    from tokenloom.specs.reference_models import REFERENCE_CONFIGS, reference_config

    if model in PRESETS:
        return get_preset(model), model
    if model in REFERENCE_CONFIGS:  # shapes of published models, never built (specs/reference_models.py)
        return reference_config(model), model
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"model {model!r}: {path} is not a config.json ({e})") from None
        return config, os.path.basename(os.path.dirname(os.path.abspath(path))) or str(path)
    raise ValueError(
        f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}), a reference model "
        f"({', '.join(sorted(REFERENCE_CONFIGS))}) nor a directory containing config.json"
    )


def load_model_spec(model: str) -> ModelSpec:
    """`ModelSpec` for a preset name or a directory holding (at least) config.json."""
    config, name = load_config(model)
    return ModelSpec.from_config(config, name=name)


def model_shape(config: dict) -> ModelShape:
    """The engine's sizing inputs (max_position_embeddings, KV heads, ...) of a config.json
    dict, read as the engine reads it (`model.hf_config`, with each family's defaults)."""
    from tokenloom.model.hf_config import model_args_fields
    from tokenloom.model.registry import resolve_architecture

    return ModelShape.from_fields(model_args_fields(config, resolve_architecture(config)))


def load_model_shape(model: str) -> ModelShape:
    """`model_shape` for a preset name or a directory holding config.json."""
    return model_shape(load_config(model)[0])


def max_position_embeddings(config: dict) -> int | None:
    """The model's max_position_embeddings as the engine reads it (its family's default when
    the file omits it); for an architecture the engine does not run, the file's value."""
    try:
        return model_shape(config).max_position_embeddings
    except ValueError:
        value = config.get("max_position_embeddings")
        return int(value) if value else None
