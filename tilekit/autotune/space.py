"""Search spaces: the grid of tile sizes and hints a kernel may run with, pruned per problem."""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Callable, Mapping

from tilekit.autotune.digest import code_digest

Config = dict[str, int]
Problem = Mapping[str, object]

HINTS = ("occupancy", "num_ctas", "num_worker_warps")  # compiler hints; every other parameter is a kernel constant


class SearchSpace:
    """A Cartesian grid of named integer parameters with a validity rule.

    `constraint(config, problem)` prunes combinations that cannot run or cannot win on a
    problem (tiles larger than the problem, shared-memory budget, ...).
    """

    def __init__(self, constraint: Callable[[Config, Problem], bool] | None = None,
                 **params: tuple[int, ...]):
        for name, values in params.items():
            if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ValueError(f"search space parameter {name!r} needs a non-empty tuple of ints")
        self.params = {name: tuple(values) for name, values in sorted(params.items())}
        self.constraint = constraint

    def __iter__(self):
        names = list(self.params)
        for values in itertools.product(*self.params.values()):
            yield dict(zip(names, values))

    def __len__(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def candidates(self, problem: Problem) -> list[Config]:
        """Every configuration that the constraint admits for `problem`."""
        return [c for c in self if self.constraint is None or self.constraint(c, problem)]

    def admits(self, config: Mapping, problem: Problem) -> bool:
        """Whether `config` is one of candidates(problem): in the space and admitted by the constraint."""
        return self.contains(config) and (self.constraint is None or bool(self.constraint(dict(config), problem)))

    def contains(self, config: Mapping) -> bool:
        """True when `config` names exactly this space's parameters with declared values."""
        return (isinstance(config, Mapping) and set(config) == set(self.params)
                and all(type(config[k]) is int and config[k] in v for k, v in self.params.items()))

    def digest(self) -> str:
        """Hash of the grid and of what the constraint does: changes when the space changes."""
        text = json.dumps(self.params, sort_keys=True)
        if self.constraint is not None:
            text += code_digest(self.constraint)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_hints(config: Config) -> tuple[dict, dict]:
    """(kernel constants, compiler hints) of a config; a hint of 0 leaves the choice to the compiler."""
    consts = {k: v for k, v in config.items() if k not in HINTS}
    hints = {k: v for k, v in config.items() if k in HINTS and v != 0}
    return consts, hints


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
