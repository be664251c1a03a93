"""How a model splits over tensor-parallel ranks: each rank's share of heads, columns and vocabulary rows, and the
parts (axis, start, stop[, groups]) of a tensor that a rank holds, which the models allocate and the checkpoint
loader reads (tilekit.checkpoints.load takes them as given). Pure functions: no GPU, no process."""

from __future__ import annotations


def span(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items split as evenly as possible (the first n % world get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


VOCAB_GRANULE = 64     # vocabulary slices start at multiples of this many entries


def vocab_span(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's vocabulary rows: span() of whole VOCAB_GRANULE blocks, so that each rank's columns
    of the logits start 128-byte aligned (bf16) however odd the vocabulary (GPT-2's 50257)."""
    blocks = -(-vocab // VOCAB_GRANULE)
    if blocks < world:
        raise ValueError(f"vocab_size ({vocab}) has fewer blocks of {VOCAB_GRANULE} than the tensor-parallel size "
                         f"{world}")
    start, stop = span(blocks, rank, world)
    return min(vocab, start * VOCAB_GRANULE), min(vocab, stop * VOCAB_GRANULE)


def even_span(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """span() of n items that must split evenly; ValueError naming `what` otherwise."""
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {world}")
    return span(n, rank, world)


def kv_head_span(kv_heads: int, heads: int, rank: int, world: int) -> tuple[int, int]:
    """The key/value heads rank holds when its query heads are span(heads): its share when they split evenly,
    else (fewer key/value heads than ranks) the one head its query heads share, replicated over world / kv_heads
    ranks."""
    even_span(heads, rank, world, "the number of attention heads")
    if kv_heads % world == 0:
        return span(kv_heads, rank, world)
    if world % kv_heads:
        raise ValueError(f"the number of key/value heads ({kv_heads}) neither divides by nor divides the "
                         f"tensor-parallel size {world}")
    head = rank * kv_heads // world
    return head, head + 1


def part_fields(part: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(axis, start, stop, groups) of a part."""
    return (*part, 1) if len(part) == 3 else tuple(part)


def part_problem(shape: tuple[int, ...], part: tuple[int, ...]) -> str | None:
    """Why `part` is not a slice (axis, start, stop[, groups]) of an array of `shape`, or None."""
    if len(part) not in (3, 4) or not all(isinstance(v, int) for v in part):
        return "not (axis, start, stop[, groups])"
    axis, start, stop, groups = part_fields(part)
    if not 0 <= axis < len(shape) or groups < 1 or shape[axis] % groups or not \
            0 <= start < stop <= shape[axis] // groups:
        return f"not a slice (axis, start, stop[, groups]) of shape {tuple(shape)}"
    return None


def part_shape(shape: tuple[int, ...], part: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of `part` of an array of `shape`."""
    axis, start, stop, groups = part_fields(part)
    return tuple(shape[:axis]) + (groups * (stop - start),) + tuple(shape[axis + 1:])


def take_part(array, part: tuple[int, ...]):
    """`part` of a NumPy or CuPy array (a view for one group, else a copy)."""
    axis, start, stop, groups = part_fields(part)
    shape = array.shape
    blocks = array.reshape(shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])
    return blocks[(slice(None),) * (axis + 1) + (slice(start, stop),)].reshape(part_shape(shape, part))
