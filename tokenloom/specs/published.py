"""Published measurements of other engines, with the setup each source states: the figures
`tokenloom estimate` and `simulate` are checked against (docs/predictions.md, tests/test_predictions.py).

Each `Figure` is one number a project or its users published -- a README table, a pull
request's benchmark, a vendor's performance page -- with the GPU, model, weight format,
parallelism and workload the source gives.  `fit=True` marks the figures the default
efficiencies (`sim.efficiency`) were set from; the others only check them.  Where a source
leaves a detail out, `note` says what was assumed.

Scenarios (how `sim.predictions` predicts them):

* "decode": tokens/s of `batch` sequences decoding (per sequence when batch is 1, in
  total otherwise), at the mean context prompt_len + output_len / 2;
* "ttft": milliseconds to prefill `prompt_len` tokens of one request and sample its first token;
* "static": a fixed batch of `batch` requests of prompt_len in / output_len out, run together
  from the first prefill to the last token (output tokens/s, per GPU when `per_gpu`);
* "serve": the simulator (the engine's scheduler on the cost model) fed `num_prompts` requests,
  all at once or `concurrency` at a time; metric "output_tok_s", "ttft_ms" or "tpot_ms".
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPT_FAST = "https://github.com/pytorch-labs/gpt-fast/blob/c9f683e/README.md#benchmarks"
GPT_FAST_SETUP = "8xA100-80GB SXM power-limited to 330 W, batch 1, 5-token prompt, 200 new tokens, torch.compile"
LLAMA_CPP_4766 = "https://github.com/ggml-org/llama.cpp/pull/4766"
MLC_BENCH = "https://github.com/mlc-ai/llm-perf-bench/blob/d401356/README.md"
MLC_SETUP = "batch 1, prompt 'What is the meaning of life?', 256 tokens decoded, q4f16_1"
LMDEPLOY_A100 = "https://github.com/InternLM/lmdeploy/blob/v0.1.0/docs/en/benchmark/a100_fp16.md"
LMDEPLOY_AWQ = "https://github.com/InternLM/lmdeploy/blob/main/docs/en/quantization/w4a16.md#performance"
TRT_V061 = "https://github.com/NVIDIA/TensorRT-LLM/blob/v0.6.1/docs/source/performance.md"
TRT_OVERVIEW = "https://github.com/NVIDIA/TensorRT-LLM/blob/main/docs/source/performance/perf-overview.md"
VLLM_A100_SWEEP = "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on"
LLAMA3_Q6K = "https://github.com/dmatora/LLM-inference-speed-benchmarks/issues/10"


@dataclass(frozen=True)
class Figure:
    """One published measurement and the setup its source states."""

    key: str
    source: str  # short name of the source
    url: str
    engine: str
    hardware: str  # catalog name (specs.hardware)
    model: str  # preset or reference model (specs.reference_models)
    dtype: str  # activations / unquantized weights
    weight_format: str | None  # specs.weight_formats name; None: every weight in `dtype`
    scenario: str  # decode | ttft | static | serve
    metric: str  # "tok_s" (decode/static/serve throughput), "ms" (ttft), "ttft_ms", "tpot_ms"
    measured: float
    batch: int = 1
    prompt_len: int = 0
    output_len: int = 0
    tp: int = 1
    kv_cache_dtype: str | None = None
    num_prompts: int = 0
    concurrency: int | None = None
    per_gpu: bool = False  # throughput reported per GPU
    engine_limits: dict = field(default_factory=dict)  # serve: max_num_seqs, max_num_batched_tokens, ...
    fit: bool = False
    setup: str = ""
    note: str = ""


def _gf(key: str, model: str, fmt: str | None, tok_s: float, *, tp: int = 1, fit: bool = False, hw: str = "a100-80gb",
        note: str = "") -> Figure:
    return Figure(key, "gpt-fast README", GPT_FAST, "gpt-fast", hw, model, "bfloat16", fmt, "decode", "tok_s", tok_s,
                  prompt_len=5, output_len=200, tp=tp, fit=fit, setup=GPT_FAST_SETUP, note=note)


_INT4_NOTE = "gpt-fast int4 = tinygemm: 4 bits + bf16 scale and zero per 32 weights (5 bits)"

FIGURES: tuple[Figure, ...] = (
    # ---------------------------------------------------------------- batch-1 decode, one GPU
    _gf("gptfast-l2-7b-bf16", "llama-2-7b", None, 104.9, fit=True),
    _gf("gptfast-l2-7b-int8", "llama-2-7b", "int8", 155.58, note="per-channel int8, bf16 scales", fit=True),
    _gf("gptfast-l2-7b-int4", "llama-2-7b", "tinygemm-int4", 196.80, note=_INT4_NOTE, fit=True),
    _gf("gptfast-l2-70b-int8", "llama-2-70b", "int8", 19.13, fit=True),
    _gf("gptfast-l2-70b-int4", "llama-2-70b", "tinygemm-int4", 25.25, note=_INT4_NOTE),
    _gf("gptfast-l31-8b-bf16", "llama-3.1-8b", None, 93.89),
    _gf("gptfast-l31-8b-int8", "llama-3.1-8b", "int8", 137.64),
    _gf("gptfast-l31-70b-int8", "llama-3.1-70b", "int8", 18.04),
    _gf("gptfast-mi250x-l2-7b-bf16", "llama-2-7b", None, 76.33, hw="mi250x-gcd", note="one GCD of an MI250X"),
    _gf("gptfast-mi250x-l2-7b-int8", "llama-2-7b", "int8", 101.86, hw="mi250x-gcd", note="one GCD of an MI250X"),
    Figure("llamacpp-4090-7b-f16", "llama.cpp PR 4766 (ggerganov, 2024-01-10)", LLAMA_CPP_4766, "llama.cpp",
           "rtx4090", "llama-2-7b", "float16", None, "decode", "tok_s", 61.03, output_len=128,
           setup="llama-bench tg128, CodeLlama-7B F16 GGUF, all layers on the GPU",
           note="CodeLlama-7B has Llama-2-7B's shape (vocab 32016)", fit=True),
    Figure("llamacpp-4090-7b-q8_0", "llama.cpp PR 4766 (ggerganov, 2024-01-10)", LLAMA_CPP_4766, "llama.cpp",
           "rtx4090", "llama-2-7b", "float16", "gguf-q8_0", "decode", "tok_s", 98.13, output_len=128,
           setup="llama-bench tg128, CodeLlama-7B Q8_0 GGUF (6.67 GiB)", fit=True),
    Figure("llamacpp-3090-7b-f16", "llama.cpp PR 4766 (JohannesGaessler)", LLAMA_CPP_4766, "llama.cpp",
           "rtx3090", "llama-2-7b", "float16", None, "decode", "tok_s", 48.52, output_len=128,
           setup="llama-bench tg128, LLaMA 7B F16, master before the PR"),
    Figure("llamacpp-3090-7b-q4_0", "llama.cpp PR 4766 (JohannesGaessler)", LLAMA_CPP_4766, "llama.cpp",
           "rtx3090", "llama-2-7b", "float16", "gguf-q4_0", "decode", "tok_s", 121.82, output_len=128,
           setup="llama-bench tg128, LLaMA 7B Q4_0, master before the PR", fit=True),
    Figure("llamacpp-3090-7b-q3_k_s", "llama.cpp PR 4766 (JohannesGaessler)", LLAMA_CPP_4766, "llama.cpp",
           "rtx3090", "llama-2-7b", "float16", "gguf-q3_k", "decode", "tok_s", 87.26, output_len=128,
           setup="llama-bench tg128, LLaMA 7B Q3_K_S (Q3_K everywhere, output Q6_K), master before the PR", fit=True),
    Figure("llamacpp-4090-l3-8b-q6_k", "LLM-inference-speed-benchmarks issue 10", LLAMA3_Q6K, "llama.cpp server",
           "rtx4090", "llama-3-8b", "float16", "gguf-q6_k", "decode", "tok_s", 93.0, prompt_len=100, output_len=400,
           setup="Llama-3-8B Q6_K GGUF, llama.cpp server, generation speed of one request",
           note="prompt and output lengths not stated; a chat turn assumed (100 in, 400 out)"),
    Figure("mlc-4090-l2-7b-q4", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "rtx4090", "llama-2-7b", "float16",
           "mlc-q4f16_1", "decode", "tok_s", 204.8, prompt_len=8, output_len=256, setup=MLC_SETUP, fit=True),
    Figure("mlc-4090-l2-13b-q4", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "rtx4090", "llama-2-13b", "float16",
           "mlc-q4f16_1", "decode", "tok_s", 113.5, prompt_len=8, output_len=256, setup=MLC_SETUP),
    Figure("mlc-3090ti-l2-7b-q4", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "rtx3090ti", "llama-2-7b", "float16",
           "mlc-q4f16_1", "decode", "tok_s", 186.7, prompt_len=8, output_len=256, setup=MLC_SETUP),
    Figure("mlc-3090ti-l2-13b-q4", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "rtx3090ti", "llama-2-13b", "float16",
           "mlc-q4f16_1", "decode", "tok_s", 107.4, prompt_len=8, output_len=256, setup=MLC_SETUP),
    Figure("lmdeploy-4090-l2-7b-awq", "LMDeploy w4a16 docs", LMDEPLOY_AWQ, "LMDeploy TurboMind", "rtx4090",
           "llama-2-7b", "float16", "awq", "decode", "tok_s", 206.4, prompt_len=1, output_len=512,
           setup="Llama-2-7B-chat AWQ 4-bit (group 128), batch 1, 1 prompt token, 512 generated", fit=True),
    Figure("lmdeploy-4090-l2-13b-awq", "LMDeploy w4a16 docs", LMDEPLOY_AWQ, "LMDeploy TurboMind", "rtx4090",
           "llama-2-13b", "float16", "awq", "decode", "tok_s", 115.8, prompt_len=1, output_len=512,
           setup="Llama-2-13B-chat AWQ 4-bit (group 128), batch 1, 1 prompt token, 512 generated"),
    Figure("lmdeploy-a100-l2-7b-fp16", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-7b", "float16", None, "decode", "tok_s", 100.02, prompt_len=1, output_len=128,
           setup="static inference, batch 1, 1 prompt token, 128 out, A100-80G, CUDA 11.8"),
    Figure("lmdeploy-a100-l2-13b-fp16", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-13b", "float16", None, "decode", "tok_s", 57.49, prompt_len=1, output_len=128,
           setup="static inference, batch 1, 1 prompt token, 128 out, A100-80G, CUDA 11.8"),
    Figure("vllm-a100-40gb-l31-8b-c1", "vLLM sweep on an A100 40GB (J. Musgrave)", VLLM_A100_SWEEP, "vLLM",
           "a100-40gb", "llama-3.1-8b", "bfloat16", None, "decode", "tok_s", 75.0, prompt_len=1024, output_len=128,
           setup="vllm serve defaults, vllm bench serve random 1024 in / 128 out, concurrency 1",
           note="'about 75 tokens/sec' at one request, as the post states; SXM assumed"),
    # ---------------------------------------------------------------- tensor parallel, batch-1 decode
    _gf("gptfast-l2-7b-tp2", "llama-2-7b", None, 168.84, tp=2, note="NVLink (hybrid cube mesh)", fit=True),
    _gf("gptfast-l2-7b-tp4", "llama-2-7b", None, 254.02, tp=4),
    _gf("gptfast-l2-7b-tp8", "llama-2-7b", None, 328.43, tp=8, fit=True),
    _gf("gptfast-l2-70b-tp2", "llama-2-70b", None, 21.32, tp=2),
    _gf("gptfast-l2-70b-tp4", "llama-2-70b", None, 38.01, tp=4),
    _gf("gptfast-l2-70b-tp8", "llama-2-70b", None, 62.50, tp=8),
    _gf("gptfast-l31-8b-tp8", "llama-3.1-8b", None, 276.01, tp=8),
    _gf("gptfast-l31-70b-tp8", "llama-3.1-70b", None, 58.78, tp=8),
    _gf("gptfast-l2-70b-tp8-int8", "llama-2-70b", "int8", 80.44, tp=8),
    _gf("gptfast-l2-70b-tp8-int4", "llama-2-70b", "tinygemm-int4", 90.77, tp=8, note=_INT4_NOTE),
    Figure("mlc-a100pcie-x2-l2-70b-fp16", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "a100-80gb-pcie",
           "llama-2-70b", "float16", None, "decode", "tok_s", 17.0, prompt_len=8, output_len=256, tp=2,
           setup="fp16, 2 x A100 over PCIe (no NVLink), batch 1, 256 tokens decoded",
           note="80GB PCIe cards assumed (fp16 70B needs 2 x 80 GB)"),
    Figure("mlc-a100pcie-x4-l2-70b-fp16", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "a100-80gb-pcie",
           "llama-2-70b", "float16", None, "decode", "tok_s", 26.6, prompt_len=8, output_len=256, tp=4,
           setup="fp16, 4 x A100 over PCIe (no NVLink), batch 1, 256 tokens decoded", note="80GB PCIe cards assumed",
           fit=True),
    Figure("mlc-a100pcie-x8-l2-70b-fp16", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "a100-80gb-pcie",
           "llama-2-70b", "float16", None, "decode", "tok_s", 38.8, prompt_len=8, output_len=256, tp=8,
           setup="fp16, 8 x A100 over PCIe (no NVLink), batch 1, 256 tokens decoded", note="80GB PCIe cards assumed"),
    Figure("mlc-a10g-x8-l2-70b-fp16", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "a10g", "llama-2-70b", "float16",
           None, "decode", "tok_s", 21.8, prompt_len=8, output_len=256, tp=8,
           setup="fp16, 8 x A10G over PCIe, batch 1, 256 tokens decoded"),
    Figure("mlc-a10g-x4-codellama-34b-fp16", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "a10g", "codellama-34b",
           "float16", None, "decode", "tok_s", 24.8, prompt_len=8, output_len=256, tp=4,
           setup="fp16, 4 x A10G over PCIe, batch 1, 256 tokens decoded"),
    Figure("mlc-4090x2-l2-70b-q4", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "rtx4090", "llama-2-70b", "float16",
           "mlc-q4f16_1", "decode", "tok_s", 34.5, prompt_len=8, output_len=256, tp=2,
           setup="4-bit, 2 x RTX 4090 over PCIe, batch 1, 256 tokens decoded"),
    Figure("mlc-a10g-x2-codellama-34b-q4", "MLC llm-perf-bench", MLC_BENCH, "MLC LLM", "a10g", "codellama-34b",
           "float16", "mlc-q4f16_1", "decode", "tok_s", 38.4, prompt_len=8, output_len=256, tp=2,
           setup="4-bit, 2 x A10G over PCIe, batch 1, 256 tokens decoded"),
    Figure("lmdeploy-a100-l2-70b-tp4", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-70b", "float16", None, "decode", "tok_s", 33.94, prompt_len=1, output_len=128, tp=4,
           setup="static inference, batch 1, tp 4, 1 prompt token, 128 out, (x8) A100-80G"),
    # ---------------------------------------------------------------- batched decode (fixed batches)
    Figure("lmdeploy-a100-l2-7b-b16", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-7b", "float16", None, "static", "tok_s", 1504.72, batch=16, prompt_len=1,
           output_len=128, setup="static inference, 16 concurrent requests of 1 prompt token, 128 out"),
    Figure("lmdeploy-a100-l2-7b-b64", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-7b", "float16", None, "static", "tok_s", 4154.81, batch=64, prompt_len=1,
           output_len=128, setup="static inference, 64 concurrent requests of 1 prompt token, 128 out", fit=True),
    Figure("lmdeploy-a100-l2-13b-b64", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-13b", "float16", None, "static", "tok_s", 3049.16, batch=64, prompt_len=1,
           output_len=128, setup="static inference, 64 concurrent requests of 1 prompt token, 128 out"),
    Figure("lmdeploy-a100-l2-70b-tp4-b64", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100, "LMDeploy TurboMind",
           "a100-80gb", "llama-2-70b", "float16", None, "static", "tok_s", 1425.79, batch=64, prompt_len=1,
           output_len=128, tp=4, setup="static inference, tp 4, 64 concurrent requests of 1 prompt token, 128 out"),
    Figure("trt-a100-l2-7b-bs384-128-128", "TensorRT-LLM v0.6.1 performance", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-7b", "float16", None, "static", "tok_s", 5586, batch=384, prompt_len=128,
           output_len=128, setup="A100 FP16, gptSessionBenchmark, batch 384, 128 in / 128 out",
           note="'A100' (80GB SXM assumed), 'LLaMA 7B' = Llama-2-7B", fit=True),
    Figure("trt-a100-l2-7b-bs60-128-2048", "TensorRT-LLM v0.6.1 performance", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-7b", "float16", None, "static", "tok_s", 1928, batch=60, prompt_len=128,
           output_len=2048, setup="A100 FP16, gptSessionBenchmark, batch 60, 128 in / 2048 out",
           note="80GB SXM assumed"),
    Figure("trt-a100-l2-7b-bs52-2048-128", "TensorRT-LLM v0.6.1 performance", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-7b", "float16", None, "static", "tok_s", 591, batch=52, prompt_len=2048,
           output_len=128, setup="A100 FP16, gptSessionBenchmark, batch 52, 2048 in / 128 out",
           note="80GB SXM assumed"),
    Figure("trt-h100-l2-7b-fp8-bs768-128-128", "TensorRT-LLM v0.6.1 performance", TRT_V061, "TensorRT-LLM",
           "h100-sxm", "llama-2-7b", "float16", "fp8", "static", "tok_s", 19694, batch=768, prompt_len=128,
           output_len=128, kv_cache_dtype="fp8", setup="H100 FP8 (weights and KV cache), batch 768, 128 in / 128 out"),
    Figure("trt-h100-l2-7b-fp8-bs112-128-2048", "TensorRT-LLM v0.6.1 performance", TRT_V061, "TensorRT-LLM",
           "h100-sxm", "llama-2-7b", "float16", "fp8", "static", "tok_s", 6818, batch=112, prompt_len=128,
           output_len=2048, kv_cache_dtype="fp8",
           setup="H100 FP8 (weights and KV cache), batch 112, 128 in / 2048 out"),
    Figure("trt-h100-l2-7b-fp8-bs80-2048-128", "TensorRT-LLM v0.6.1 performance", TRT_V061, "TensorRT-LLM",
           "h100-sxm", "llama-2-7b", "float16", "fp8", "static", "tok_s", 2244, batch=80, prompt_len=2048,
           output_len=128, kv_cache_dtype="fp8",
           setup="H100 FP8 (weights and KV cache), batch 80, 2048 in / 128 out", fit=True),
    Figure("trt-l40s-l2-7b-fp8-bs64-128-128", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061,
           "TensorRT-LLM", "l40s", "llama-2-7b", "float16", "fp8", "static", "tok_s", 3240, batch=64, prompt_len=128,
           output_len=128, kv_cache_dtype="fp8", setup="L40S FP8, batch 64, 128 in / 128 out"),
    Figure("trt-l40s-l2-7b-fp8-bs32-2048-128", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061,
           "TensorRT-LLM", "l40s", "llama-2-7b", "float16", "fp8", "static", "tok_s", 581, batch=32, prompt_len=2048,
           output_len=128, kv_cache_dtype="fp8", setup="L40S FP8, batch 32, 2048 in / 128 out"),
    # ---------------------------------------------------------------- time to first token, batch 1
    Figure("trt-a100-l2-7b-ttft-128", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-7b", "float16", None, "ttft", "ms", 16, prompt_len=128,
           setup="A100 FP16, 1st token latency, batch 1, 128 input tokens", note="80GB SXM assumed", fit=True),
    Figure("trt-a100-l2-7b-ttft-2048", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-7b", "float16", None, "ttft", "ms", 133, prompt_len=2048,
           setup="A100 FP16, 1st token latency, batch 1, 2048 input tokens", note="80GB SXM assumed", fit=True),
    Figure("trt-a100-l2-70b-tp4-ttft-128", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-70b", "float16", None, "ttft", "ms", 47, prompt_len=128, tp=4,
           setup="A100 FP16, tp 4, 1st token latency, batch 1, 128 input tokens", note="80GB SXM assumed"),
    Figure("trt-a100-l2-70b-tp4-ttft-2048", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "a100-80gb", "llama-2-70b", "float16", None, "ttft", "ms", 377, prompt_len=2048, tp=4,
           setup="A100 FP16, tp 4, 1st token latency, batch 1, 2048 input tokens", note="80GB SXM assumed"),
    Figure("trt-h100-l2-7b-fp8-ttft-128", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "h100-sxm", "llama-2-7b", "float16", "fp8", "ttft", "ms", 7, prompt_len=128, kv_cache_dtype="fp8",
           setup="H100 FP8, 1st token latency, batch 1, 128 input tokens"),
    Figure("trt-h100-l2-7b-fp8-ttft-2048", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "h100-sxm", "llama-2-7b", "float16", "fp8", "ttft", "ms", 36, prompt_len=2048, kv_cache_dtype="fp8",
           setup="H100 FP8, 1st token latency, batch 1, 2048 input tokens", fit=True),
    Figure("trt-h100-l2-70b-fp8-tp4-ttft-2048", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061,
           "TensorRT-LLM", "h100-sxm", "llama-2-70b", "float16", "fp8", "ttft", "ms", 109, prompt_len=2048, tp=4,
           kv_cache_dtype="fp8", setup="H100 FP8, tp 4, 1st token latency, batch 1, 2048 input tokens"),
    Figure("trt-l40s-l2-7b-fp8-ttft-128", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "l40s", "llama-2-7b", "float16", "fp8", "ttft", "ms", 14, prompt_len=128, kv_cache_dtype="fp8",
           setup="L40S FP8, 1st token latency, batch 1, 128 input tokens"),
    Figure("trt-l40s-l2-7b-fp8-ttft-2048", "TensorRT-LLM v0.6.1 performance (v0.5 data)", TRT_V061, "TensorRT-LLM",
           "l40s", "llama-2-7b", "float16", "fp8", "ttft", "ms", 73, prompt_len=2048, kv_cache_dtype="fp8",
           setup="L40S FP8, 1st token latency, batch 1, 2048 input tokens"),
    Figure("lmdeploy-a100-l2-13b-ttft-2048", "LMDeploy A100 benchmark (v0.1.0a1)", LMDEPLOY_A100,
           "LMDeploy TurboMind", "a100-80gb", "llama-2-13b", "float16", None, "ttft", "ms", 242, prompt_len=2048,
           setup="static inference, batch 1, 2048 prompt tokens: first-token latency"),
    # ---------------------------------------------------------------- serving at saturation (the simulator)
    Figure("trt-h100-l31-8b-fp8-2048-128", "TensorRT-LLM performance overview", TRT_OVERVIEW, "TensorRT-LLM",
           "h100-sxm", "llama-3.1-8b", "bfloat16", "fp8", "serve", "output_tok_s", 3450, prompt_len=2048,
           output_len=128, num_prompts=600, kv_cache_dtype="fp8",
           engine_limits={"max_num_seqs": 2048, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.95},
           setup="H100 SXM, nvidia/Llama-3.1-8B-Instruct-FP8, trtllm-bench throughput, 3000 requests 2048/128",
           note="the engine's limits are not printed: max batch 2048 and 8192 tokens a step assumed; "
                "600 of the 3000 requests simulated (steady state is reached within the first 100)"),
)


def figure(key: str) -> Figure:
    for f in FIGURES:
        if f.key == key:
            return f
    raise KeyError(key)
