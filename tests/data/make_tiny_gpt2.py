"""Make tests/data/tiny-gpt2/: a tiny random GPT-2 saved by Hugging Face transformers, with its logits.

The weights are tilekit's random_state_dict(CONFIG, SEED), so our own code can rebuild them; the logits come
from transformers' GPT2LMHeadModel (fp32, eager attention) and are the ground truth the tests hold the NumPy
and GPU models to. tokenizer.json is a byte-level BPE trained on the text below, with GPT-2's <|endoftext|> as
its last id, so that text generation can be tested without downloading GPT-2's tokenizer.

Run from the repository root with CPU torch and transformers in a venv of their own (not the project's):

    python3 -m venv /work/hfvenv
    /work/hfvenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers numpy
    /work/hfvenv/bin/python tests/data/make_tiny_gpt2.py

Last run with torch 2.13.0, transformers 5.23.0, tokenizers 0.23.3, safetensors 0.8.0.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2Config, GPT2LMHeadModel

OUT = Path(__file__).resolve().parent / "tiny-gpt2"
sys.path.insert(0, str(OUT.parents[2]))  # the repository root, so that tilekit imports without installing

from tilekit.models.gpt2.weights import load_state_dict, random_state_dict  # noqa: E402
from tilekit.models.gpt2.config import GPTConfig  # noqa: E402

# An odd vocabulary, like GPT-2's 50257, so that kernels meet a ragged last tile.
CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=1031, block_size=64)
SEED = 20240601
EOT = "<|endoftext|>"
PROMPT = "The river ran slowly past the old mill, and the children sat on the stone wall to watch"

# Training text for the tokenizer, written for this fixture.
CORPUS = """\
The river ran slowly past the old mill, and the children sat on the stone wall to watch the water turn the
wheel. Every morning the miller opened the gate, checked the grain, and swept the floor before the first cart
arrived from the farms on the hill. In the spring the fields were green and wet; by late summer they were gold,
and the road was loud with wagons, horses, dogs and people who had come to sell what they had grown.

A small town grows the way a tree does: one ring at a time. First there is a crossing, then a well, then a
market, and after many years a school, a library and a train station. The people who live there rarely notice
the change, because each day looks almost exactly like the one before it. Only the old photographs show how
much has moved: the bakery is now a bank, the blacksmith's yard is a parking lot, and the pond is a park.

Computers work in a similar way. A program is a list of simple steps, and each step does very little on its
own. It adds two numbers, copies a value from one place to another, or compares a result with zero. What makes
the machine useful is that it can perform billions of these steps every second without getting tired or bored.
A graphics processor takes this idea further by running thousands of small threads at the same time, each one
working on its own tile of the data. Matrix multiplication, which sits at the heart of modern language models,
is a perfect fit for such hardware, since every output element can be computed independently of the others.

When you train a language model, you show it a very long stream of text and ask it to guess the next word.
At first the guesses are random and the loss is high. Slowly, after many passes over the data, the model learns
which letters tend to follow which, then which words appear together, and finally something about grammar,
facts and style. A tokenizer breaks the text into pieces before the model sees it. Byte pair encoding starts
from single bytes and repeatedly merges the most frequent pair into a new symbol, so common words become one
token while rare words are spelled out from smaller parts.

The weather this week has been strange. On Monday it was warm enough to walk outside without a coat; on Tuesday
a cold wind came down from the north and brought hail, thunder and a short burst of snow. Wednesday was quiet and
grey. By Thursday the sun was back, the birds were singing again, and the neighbours were out in their gardens,
planting beans, onions, carrots, lettuce and potatoes in long straight rows. Friday brought rain, which everyone
agreed the gardens needed, and on Saturday the market was busier than it had been all year.

She opened the letter carefully, as if the paper might break, and read it twice before she said anything.
"They want us to come in June," she told him. "The whole family, for the wedding. Your brother says there is
room in the house for everyone, and the children can sleep in the attic like we used to." He laughed and said
that the attic had been too small for them thirty years ago, and it would certainly be too small now.

Good engineering is mostly about careful measurement. Before you change a system, write down how fast it is
and how often it fails. After the change, measure again under the same conditions. If the numbers did not move,
the change was not worth making, no matter how clever it seemed. Keep the tests short, keep the logs readable,
and never trust a benchmark that you ran only once. Small, honest experiments beat large, confident guesses.

The recipe is simple. Mix two cups of flour with a spoon of salt and a spoon of sugar. Add warm water and a little
yeast, stir until the dough comes together, then knead it for ten minutes on a floured table. Cover the bowl with
a cloth and leave it somewhere warm for an hour, until the dough has doubled in size. Shape it into a loaf, let it
rise again, and bake it in a hot oven for about forty minutes, until the crust is brown and sounds hollow.

Numbers and symbols appear in text as well: 1, 2, 3, 10, 42, 100, 2024, 3.14, 50%, $20, #7, (a + b) * c = d,
x[i] = y[j] - 1; if (n > 0) { return n; } else { return -n; } for i in range(10): print(i, i ** 2).
"""

def make_tokenizer(vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE with `vocab_size` ids, <|endoftext|> the last of them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer)
    tokenizer.add_special_tokens([EOT])
    assert tokenizer.get_vocab_size() == vocab_size and tokenizer.token_to_id(EOT) == vocab_size - 1
    return tokenizer


def main() -> None:
    tokenizer = make_tokenizer(CONFIG.vocab_size)
    eot = tokenizer.token_to_id(EOT)
    hf_config = GPT2Config(vocab_size=CONFIG.vocab_size, n_positions=CONFIG.block_size, n_embd=CONFIG.n_embd,
                           n_layer=CONFIG.n_layer, n_head=CONFIG.n_head, layer_norm_epsilon=CONFIG.layer_norm_epsilon,
                           activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=eot, eos_token_id=eot)
    model = GPT2LMHeadModel._from_config(hf_config, attn_implementation="eager", dtype=torch.float32).eval()
    state = random_state_dict(CONFIG, SEED)
    model.transformer.load_state_dict({name: torch.from_numpy(array) for name, array in state.items()}, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight, "the LM head must stay tied to wte"

    # One row of real text, one of random ids (the last id, <|endoftext|>, included).
    text = tokenizer.encode(PROMPT).ids[:16]
    noise = np.random.default_rng(SEED).integers(0, CONFIG.vocab_size, size=16)
    noise[-1] = eot
    input_ids = np.array([text, noise], dtype=np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids)).logits.numpy()

    OUT.mkdir(exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    np.save(OUT / "input_ids.npy", input_ids)
    np.save(OUT / "logits.npy", logits.astype(np.float32))

    config, loaded = load_state_dict(OUT)
    assert config == CONFIG.replace(bos_token_id=eot, eos_token_id=eot) and all(
        np.array_equal(loaded[name], state[name]) for name in state), \
        "the saved checkpoint must hold exactly random_state_dict(CONFIG, SEED)"
    print(f"wrote {OUT}: input_ids {input_ids.shape}, logits {logits.shape}, "
          f"model.safetensors {(OUT / 'model.safetensors').stat().st_size} bytes")


if __name__ == "__main__":
    main()
