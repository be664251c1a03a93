"""The DeepSeek-V2 family (multi-head latent attention, a mixture of experts): config, Hugging Face weights,
NumPy reference."""
