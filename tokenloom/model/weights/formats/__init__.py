"""Checkpoints that arrive already quantized, read as the library that wrote them lays them out.

One module per format (GGUF; GPTQ / AWQ; compressed-tensors): each turns the file's tensors into
the weights our linears run -- kept in our int8 / int4 kernels' layouts where the bits map onto
them, dequantized at load where they do not -- and refuses, naming the setting, what it cannot read.
"""
