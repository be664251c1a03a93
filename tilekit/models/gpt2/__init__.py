"""The GPT-2 family (gpt2 to gpt2-xl): config, weights, model, reference and patch rules."""
