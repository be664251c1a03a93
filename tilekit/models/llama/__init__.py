"""The Llama family (Llama 2/3.x, TinyLlama): config, weights, model, reference and patch rules."""
