"""The gpt-fast-style DeepSeek-V2 anchor (benchmarks.suites.gptfast) against transformers' own model, in float32 on
the CPU (needs PyTorch and transformers: the GPU host has both): the absorbed latent attention, the per-token gathered
experts of a decode step and the eager prompt give HF's logits and greedy tokens."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora"])   # YaRN; query compression
def test_deepseek_v2_decoder_gives_the_hf_models_logits_and_tokens(name):
    from benchmarks.suites.gptfast import decoder_for
    hf = transformers.AutoModelForCausalLM.from_pretrained(DATA / name, dtype=torch.float32).eval()
    B, T0, new = 2, 20, 12
    prompt = torch.randint(0, hf.config.vocab_size, (B, T0), generator=torch.Generator().manual_seed(0))
    decoder = decoder_for(hf, B, T0 + new, compile=False)
    with torch.no_grad():
        tokens, logits = decoder.generate(prompt, new)
        ref = hf(prompt).logits[:, -1]
        assert ((logits - ref).norm() / ref.norm()).item() < 1e-5
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert torch.equal(theirs, tokens)
        # the last decode step again (one token: the gathered experts) against HF's whole-sequence forward
        decoder.pos.fill_(T0 + new - 2)
        step = decoder.forward(tokens[:, T0 + new - 2:T0 + new - 1], decoder.pos)
        full = hf(tokens[:, :-1]).logits[:, -1]
        assert ((step - full).norm() / full.norm()).item() < 1e-5
