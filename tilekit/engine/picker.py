"""What the captured next-token kernels of a generation are built for (kernels.next_token picks each next token on
the GPU inside the captured step): the kinds of sampling its rows ask for, decided once per batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tilekit.engine.sampling import SamplingParams
from tilekit.kernels.next_token import candidate_slots


@dataclass(frozen=True)
class Picker:
    """What the captured next-token kernels of a generation are built for (its graphs hold them): token
    counts for penalties, candidate slots for top-k rows, the check pass of top-p rows without top-k, the
    eos ids and the token a finished row emits; `masked`: structured output's bitmask put on the logits first."""

    penalties: bool = False
    slots: int = 0
    check: bool = False
    eos: tuple[int, ...] = ()
    pad: int = 0
    masked: bool = False

    @classmethod
    def for_rows(cls, rows: Sequence[SamplingParams], eos: Sequence[int], masked: bool = False) -> "Picker":
        sampled = [r for r in rows if not r.greedy]
        return cls(penalties=any(r.repetition_penalty != 1 or r.presence_penalty or r.frequency_penalty for r in rows),
                   slots=candidate_slots(r.top_k for r in sampled),
                   check=any(r.top_k == 0 and r.top_p < 1 for r in sampled),
                   eos=tuple(eos), pad=eos[0] if eos else 0, masked=masked)


GREEDY = Picker()
# generate()'s picks as the tuning workload records them: greedy, and Hugging Face's default sampling (top_k 50)
WORKLOAD_PICKERS = (GREEDY, Picker.for_rows([SamplingParams(temperature=1.0, top_k=50)], ()))
