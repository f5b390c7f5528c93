"""The weights: reading a checkpoint (loader), sharding it for tensor parallel (parallel),
packing it for our GEMMs (packed_linear) and quantizing it (quantization, quant_schemes).

The network (`tokenloom.model`) never knows which format a weight came in; a new checkpoint
format (GGUF, GPTQ/AWQ, compressed-tensors) lands here as a reader into these packed weights.
"""
