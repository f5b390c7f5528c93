"""Tools that make models rather than run them: the tiny presets (presets), a random-weight
checkpoint writer (make_model, `tokenloom make-model`) and the byte-level BPE tokenizer
builder (tokenizer_builder)."""
